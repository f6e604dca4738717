# session 14: vCPU probe, then tl2 with spin on/off interleaved
. .gpuh/setup.sh
python3 .gpuh/cpuprobe.py 2>&1 | tee $OUT/cpuprobe.txt
for i in 1 2 3 4; do
  for s in default 0; do
    echo "## spin=$s"
    if [ $s = 0 ]; then export DISAGG_SPIN_US=0; else unset DISAGG_SPIN_US; fi
    DEV=cuda timeout 120 python3 .gpuh/tl2.py 65536 16384 24 2>&1 | grep -E "part|first launch"
  done
done 2>&1 | tee $OUT/tl-spin.txt
