# session 13: the tcp rows (host memory) on the 16-core H200 host, 3 runs
. .gpuh/setup.sh
for i in 1 2 3; do
  echo "== run $i" >> $OUT/tcp.txt
  timeout 250 python3 -m disagg bench transfer --transports ucx-tcp,zmq-tcp --page-sizes 64KiB,256KiB,1MiB,4MiB --total 256MiB --repeats 5 2>&1 | grep -E "GB/s|ceilings|rror" >> $OUT/tcp.txt
done
grep -E "==|64KiB" $OUT/tcp.txt
