# session 14: final code (first half capped at 8192): CUDA tests, A/B vs 4096, the bench
. .gpuh/setup.sh
export DISAGG_TEST_DEVICE=cuda
timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 120 tests/transport/test_ipc_parts.py tests/transport/test_ipc_plane.py > $OUT/tests-ipc-cuda.txt 2>&1; echo "tests rc=$?"; tail -3 $OUT/tests-ipc-cuda.txt
unset DISAGG_TEST_DEVICE
for i in 1 2; do
  for cfg in "65536 16384" "65536 32768"; do
    set -- $cfg
    for p in 4096 default; do
      if [ $p = default ]; then unset DISAGG_IPC_PARTS; else export DISAGG_IPC_PARTS=$p; fi
      PAGE=$1 NPAGES=$2 timeout 120 python3 .gpuh/pp.py none 30 2>&1 | grep -v CudaIPC | head -1
    done
  done
done 2>&1 | tee $OUT/final-ab.txt
unset DISAGG_IPC_PARTS
for i in 1 2 3; do
  echo "== round $i"
  timeout 150 python3 -m disagg bench gpu --ipc-only --page-sizes 64KiB,1MiB --total 1GiB --ipc-depths 1,4 2>&1 | grep -E "ipc|d2d|rror"
done 2>&1 | tee $OUT/bench-ipc.txt
