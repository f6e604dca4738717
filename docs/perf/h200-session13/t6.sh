# session 13: zmq tcp batch size + send buffer A/B on the 16-core H200 host (CPU only)
. .gpuh/setup.sh
cat /proc/sys/net/core/wmem_max /proc/sys/net/ipv4/tcp_wmem /proc/sys/net/ipv4/tcp_rmem > $OUT/sysctl.txt; nproc >> $OUT/sysctl.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/transport/test_zmq_store_rows.py > $OUT/tests-zmq.txt 2>&1; tail -2 $OUT/tests-zmq.txt
OLD="DISAGG_STREAM_TCP_MSG_BYTES=8388608 DISAGG_STREAM_TCP_SNDBUF=0"
NEW="X=1"
for i in 1 2 3 4; do
  for e in $( [ $((i%2)) = 1 ] && echo "OLD NEW" || echo "NEW OLD" ); do
    [ $e = OLD ] && ev=$OLD || ev=$NEW
    echo "== $e pair $i" >> $OUT/ab.txt
    env $ev timeout 200 python3 -m disagg bench transfer --transports zmq-tcp --page-sizes 64KiB,256KiB,1MiB,4MiB --total 256MiB --repeats 5 2>&1 | grep -E "GB/s|ceilings" >> $OUT/ab.txt
  done
done
cat $OUT/ab.txt | tail -12
