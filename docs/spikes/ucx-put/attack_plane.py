"""Does today's tcp consumer (UcxDataPlane(channel="tcp"): TAG + WAKEUP, no RMA feature)
accept a forged ucp_put_nbx from any process that reaches its UCX listener?

Run from the worktree root: PYTHONPATH=$PWD python docs/spikes/ucx-put/attack_plane.py
(optionally with UCX_TCP_PUT_ENABLE=n in the environment, which the consumer inherits)."""

import os
import subprocess
import sys
import time
from urllib.parse import urlparse

import numpy as np

from disagg import hostmem
from disagg.transport.ucx_plane import UcxDataPlane

plane = UcxDataPlane(channel="tcp")
pool = hostmem.empty((16, 65536))
pool.fill_(0)
plane.register_regions([[pool]])
ep = plane.endpoint
port = urlparse(ep.replace("ucx+tcp", "tcp")).port
addr = pool.data_ptr() + 5 * 65536  # slot 5 of the consumer's pool
spike = os.path.join(os.path.dirname(os.path.abspath(__file__)), "putspike")
# the attacker runs with UCX's defaults (tcp put_zcopy on), whatever the consumer was given
env = {k: v for k, v in os.environ.items() if k != "UCX_TCP_PUT_ENABLE"}
r = subprocess.run(
    [spike, "attack", str(port), hex(addr)], capture_output=True, text=True, timeout=60, env=env
)
print(f"attacker rc={r.returncode}:", r.stderr.strip()[-400:])
time.sleep(0.5)
got = pool.numpy()[5, :64].copy().view(np.uint64)
hit = bool((got == 0xDEADBEEFCAFEF00D).all())
print(
    f"endpoint {ep}, UCX_TCP_PUT_ENABLE={os.environ.get('UCX_TCP_PUT_ENABLE', '(default)')}: "
    f"pool slot 5 {'WRITTEN by the forged put' if hit else 'untouched'}"
)
plane.close()
sys.exit(1 if hit else 0)
