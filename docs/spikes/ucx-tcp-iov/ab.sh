#!/bin/bash
# Alternating `disagg bench transfer` runs of the UCX tcp plane, each under flock.
# usage: ab.sh ROUNDS VARIANT...  (A: today's defaults; B: hardened, ring; C: hardened,
# iov sends (the default there); C64: C + UCX_TCP_MAX_IOV=64). Outputs: $OUT/<variant>.<time>.txt
cd "$(dirname "$0")/../../.." || exit 1
OUT=${OUT:-/tmp/ucx-tcp-iov}; mkdir -p "$OUT"
H="UCX_TCP_PUT_ENABLE=n UCX_RNDV_SCHEME=am UCX_TCP_TX_SEG_SIZE=2m UCX_TCP_RX_SEG_SIZE=2m"
R=$1; shift
for r in $(seq 1 "$R"); do
  for v in "$@"; do
    case $v in
      A) E="";;
      B) E="$H DISAGG_UCX_TCP_IOV=0";;
      C) E="$H";;
      C64) E="$H UCX_TCP_MAX_IOV=64";;
    esac
    f=$OUT/$v.$(date +%H%M%S).txt
    env $E PYTHONPATH=. flock /tmp/bench.lock timeout 500 /work/venv/bin/python -m disagg bench transfer \
      --transports ucx-tcp --page-sizes 64KiB,256KiB,1MiB --total 256MiB --repeats 5 > "$f" 2>&1
    echo "$v: $(grep -E '^ucx' "$f" | awk '{print $3"="$4"("$7")"}' | tr '\n' ' ')"
  done
done
