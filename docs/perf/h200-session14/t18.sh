# session 14: is the first pushes' transient one-time (lazy init) or does it come back after a pause?
. .gpuh/setup.sh
for i in 1 2; do
  PAUSE_AT=20 PAUSE_MS=300 timeout 120 python3 .gpuh/pp.py none 45 2>&1 | grep -v CudaIPC
  PAUSE_AT=20 PAUSE_MS=3000 timeout 120 python3 .gpuh/pp.py none 45 2>&1 | grep -v CudaIPC
done 2>&1 | tee $OUT/transient.txt
