#!/bin/bash
# A/B: main worktree ($1) against this branch ($2), $3 pairs, each pair under one flock.
A=$1; B=$2; N=${3:-3}
run() { cd "$1" && PYTHONPATH="$1" /work/venv/bin/python -m disagg bench transfer --transports zmq-tcp --page-sizes 64KiB,1MiB --total 256MiB --repeats 5 2>&1 | grep -E "^zmq|ceilings"; }
for i in $(seq 1 "$N"); do
  flock /tmp/bench.lock bash -c "$(declare -f run); if [ $((i % 2)) = 1 ]; then echo '== A main'; run $A; echo '== B prof64'; run $B; else echo '== B prof64'; run $B; echo '== A main'; run $A; fi"
done
