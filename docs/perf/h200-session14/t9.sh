# session 14: where does the single push's run-to-run spread come from?
. .gpuh/setup.sh
nproc; lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node" ; cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list
cat /sys/devices/system/cpu/cpufreq/scaling_governor 2>/dev/null | head -1
for i in 1 2 3; do
  for mode in none split same; do
    timeout 120 python3 .gpuh/pp.py $mode 30 2>&1 | tail -3
  done
done 2>&1 | tee $OUT/pp.txt
