#!/bin/sh
# usage: sweep.sh PAGE "mode:err:wait ..." [REPS] -- one line per configuration, run back to back
# (wrap in flock /tmp/bench.lock). 256 MiB per transfer, store and pool of 2N rows.
cd "$(dirname "$0")"
export UCX_TLS=${UCX_TLS:-tcp,self} UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
PAGE=$1; N=$((268435456 / PAGE)); REPS=${3:-5}
for c in $2; do
  IFS=: read m e w <<X
$c
X
  timeout 90 ./putspike $PAGE $N $REPS $m ${e:-none} ${w:-block} ${NSEG:-4} ${SEG:-2097152} 2>&1 | grep -v "Connection reset\|^\s*$" || echo "$c: rc=$? (timeout/failed)"
done
