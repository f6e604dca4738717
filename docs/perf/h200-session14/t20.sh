# session 14: the UCX plane's whole-batch (GPU) path after accept_runs
. .gpuh/setup.sh
timeout 240 python3 -m pytest -q -p no:cacheprovider --timeout 120 tests/transport/test_ucx_plane.py -k "cuda_push_scattered" tests/transport/test_batch_runs.py > $OUT/ucx-cuda-tests.txt 2>&1; echo rc=$?
tail -5 $OUT/ucx-cuda-tests.txt
