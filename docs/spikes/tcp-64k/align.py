"""Spike: does the stream offset of the payload (mod 64) change raw loopback TCP speed?

Two processes; the sender streams NBYTES from a hostmem (2 MiB-aligned) buffer in 1 MiB
sendall()s after `k` lead bytes, the receiver reads the k bytes, then recv_into()s an
aligned hostmem buffer (like ceilings.stream_timer). k=0 is the bench's ceiling.
usage: PYTHONPATH=. python docs/spikes/tcp-64k/align.py [reps] [k ...]
"""

import multiprocessing as mp
import socket
import sys
import time

from disagg import hostmem

NBYTES = 256 << 20
CH = 1 << 20


def sender(port: int) -> None:
    src = hostmem.empty(NBYTES).numpy()
    src.fill(7)
    mv = src.data
    s = socket.create_connection(("127.0.0.1", port))
    while True:
        cmd = s.recv(2)
        if len(cmd) < 2 or cmd[:1] != b"g":
            return
        k = cmd[1]
        if k:
            s.sendall(b"x" * k)
        for off in range(0, NBYTES, CH):
            s.sendall(mv[off : off + CH])


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    ks = [int(x) for x in sys.argv[2:]] or [0, 13]
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    p = mp.get_context("spawn").Process(target=sender, args=(srv.getsockname()[1],))
    p.start()
    c, _ = srv.accept()
    dst = hostmem.empty(NBYTES).numpy()
    dst.fill(0)
    mv = dst.data
    res: dict[int, list[float]] = {k: [] for k in ks}
    lead = bytearray(256)
    for r in range(reps + 1):
        for k in ks:
            t = time.perf_counter()
            c.sendall(b"g" + bytes([k]))
            got = 0
            while got < k:
                got += c.recv_into(memoryview(lead)[got:k], k - got)
            got = 0
            while got < NBYTES:
                got += c.recv_into(mv[got:], NBYTES - got)
            dt = time.perf_counter() - t
            if r:
                res[k].append(NBYTES / dt / 1e9)
    c.sendall(b"q\0")
    p.join()
    for k in ks:
        v = sorted(res[k])
        print(f"k={k:3d}: median {v[len(v) // 2]:.2f} GB/s  range {v[0]:.2f}-{v[-1]:.2f}")


if __name__ == "__main__":
    main()
