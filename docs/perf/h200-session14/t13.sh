# session 14: first-part size A/B (DISAGG_IPC_PARTS), interleaved, per-push times
. .gpuh/setup.sh
sed -i "s/if left < 3 \* n:/if left < 2 * n:/" disagg/transport/ipc_plane.py; grep -n "left < " disagg/transport/ipc_plane.py
for i in 1 2 3 4; do
  for p in 4096 6144 8192 0; do
    echo "## parts=$p"
    DISAGG_IPC_PARTS=$p timeout 120 python3 .gpuh/pp.py none 30 2>&1 | grep -v CudaIPC
  done
done 2>&1 | tee $OUT/parts-ab.txt
