"""Spike: what a 0.2 ms Python polling thread in the receiving process (like the bench's
_await loop, which runs during every timed push but not during the paired ceiling) costs
the raw loopback TCP ceiling. Alternates off/on per repetition.
usage: PYTHONPATH=. python docs/spikes/tcp-64k/pollcost.py [reps]
"""

import multiprocessing as mp
import socket
import sys
import threading
import time

from disagg import hostmem

NBYTES = 256 << 20
CH = 1 << 20


def sender(port: int) -> None:
    src = hostmem.empty(NBYTES).numpy()
    src.fill(7)
    mv = src.data
    s = socket.create_connection(("127.0.0.1", port))
    while s.recv(1) == b"g":
        for off in range(0, NBYTES, CH):
            s.sendall(mv[off : off + CH])


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    p = mp.get_context("spawn").Process(target=sender, args=(srv.getsockname()[1],))
    p.start()
    c, _ = srv.accept()
    dst = hostmem.empty(NBYTES).numpy()
    dst.fill(0)
    mv = dst.data
    res: dict[bool, list[float]] = {False: [], True: []}
    wakeups = [0]
    for r in range(reps + 1):
        for polling in (False, True):
            stop = threading.Event()

            def poller(stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    time.sleep(0.0002)
                    wakeups[0] += 1

            th = threading.Thread(target=poller) if polling else None
            if th:
                th.start()
            t = time.perf_counter()
            c.sendall(b"g")
            got = 0
            while got < NBYTES:
                got += c.recv_into(mv[got:], NBYTES - got)
            dt = time.perf_counter() - t
            stop.set()
            if th:
                th.join()
            if r:
                res[polling].append(NBYTES / dt / 1e9)
    c.sendall(b"q")
    p.join()
    for k, v in res.items():
        v = sorted(v)
        print(f"poll={k}: median {v[len(v) // 2]:.2f} GB/s range {v[0]:.2f}-{v[-1]:.2f} {v}")
    print("wakeups", wakeups[0])


if __name__ == "__main__":
    main()
