# session 14: halves (new default) vs 4096 first part (old default), interleaved
. .gpuh/setup.sh
for i in 1 2 3; do
  for cfg in "65536 16384" "65536 12288" "65536 32768" "32768 32768"; do
    set -- $cfg
    for p in 4096 default; do
      if [ $p = default ]; then unset DISAGG_IPC_PARTS; else export DISAGG_IPC_PARTS=$p; fi
      PAGE=$1 NPAGES=$2 timeout 120 python3 .gpuh/pp.py none 30 2>&1 | grep -v CudaIPC
    done
  done
done 2>&1 | tee $OUT/halves-ab.txt
