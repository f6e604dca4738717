# session 14: py-spy over many back-to-back 1 GiB pushes (receiver and sender stacks)
. .gpuh/setup.sh
pip install -q --no-index --no-deps --target /tmp/spy .gpuh/py_spy-*.whl 2>&1 | tail -1
SPY=/tmp/spy/bin/py-spy; ls -la $SPY || SPY=$(find /tmp/spy -name py-spy -type f | head -1)
DEV=cuda python3 .gpuh/tl2.py 65536 16384 1200 > $OUT/tl-long.txt 2>&1 &
MAIN=$!
sleep 1
$SPY record --pid $MAIN --subprocesses --rate 2000 --format raw --threads --nonblocking -d 40 -o $OUT/spy.txt > $OUT/spy.log 2>&1
wait $MAIN
tail -5 $OUT/tl-long.txt; tail -3 $OUT/spy.log; wc -l $OUT/spy.txt
