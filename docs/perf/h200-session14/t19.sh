# session 14: the full GPU table at this tree
. .gpuh/setup.sh
timeout 380 python3 -m disagg bench gpu --page-sizes 16KiB,64KiB,256KiB,1MiB,4MiB --total 1GiB --ipc-depths 1,4,8 --json 2>&1 | grep -v CudaIPC | tee $OUT/bench-gpu.txt
