# session 14: per-run GPU copy time vs total (is the run-to-run spread GPU or CPU?)
. .gpuh/setup.sh
for i in 1 2 3 4 5; do
  DEV=cuda timeout 120 python3 .gpuh/tl2.py 65536 16384 24 2>&1 | grep -v Warn | grep -v CudaIPC
done 2>&1 | tee $OUT/tl.txt
