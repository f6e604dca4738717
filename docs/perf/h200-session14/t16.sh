# session 14: the bench with 15 repeats per depth (median of pushes 2-16), final code
. .gpuh/setup.sh
for i in 1 2 3; do
  echo "== round $i (--repeats 15)"
  timeout 150 python3 -m disagg bench gpu --ipc-only --page-sizes 64KiB --total 1GiB --ipc-depths 1,4 --repeats 15 2>&1 | grep -E "ipc|d2d|rror"
  echo "== round $i (--repeats 5)"
  timeout 150 python3 -m disagg bench gpu --ipc-only --page-sizes 64KiB --total 1GiB --ipc-depths 1,4 2>&1 | grep -E "ipc|d2d|rror"
done 2>&1 | tee $OUT/bench-ipc-r15.txt
