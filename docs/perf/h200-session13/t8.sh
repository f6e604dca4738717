# session 13: re-measure the ipc plane's single push at the current code (4 rounds)
. .gpuh/setup.sh
for i in 1 2 3 4; do
  echo "== round $i" >> $OUT/ipc.txt
  timeout 200 python3 -m disagg bench gpu --ipc-only --page-sizes 64KiB,1MiB --total 1GiB --ipc-depths 1,4 2>&1 | grep -E "ipc|d2d|rror" >> $OUT/ipc.txt
done
grep -E "==|1 push" $OUT/ipc.txt
