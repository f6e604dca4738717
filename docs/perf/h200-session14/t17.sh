# session 14: the bench as shipped now (5 warm-up pushes, first half <= 8192 pages), 3 rounds
. .gpuh/setup.sh
for i in 1 2 3; do
  echo "== round $i"
  timeout 150 python3 -m disagg bench gpu --ipc-only --page-sizes 64KiB,1MiB --total 1GiB --ipc-depths 1,4 2>&1 | grep -E "ipc|d2d|rror"
done 2>&1 | tee $OUT/bench-ipc-final.txt
