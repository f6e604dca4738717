"""Is a scattered destination slower for the kernel's receive copy? (session 12)

One sender process streams 256 MiB per go byte over loopback TCP (1 MiB sendall chunks
from a hostmem buffer, like ceilings.socket_gbps); the receiver alternates, per
repetition: (a) recv_into one contiguous hostmem buffer (the bench's raw TCP ceiling)
and (b) recvmsg_into a random permutation of PAGE-sized slots of a 2x hostmem pool
(iovecs of up to 1024 slots per call, as the zmq plane's C loop does), and (c) the same
slots in ascending order. usage: scatter_ceiling.py PAGE_BYTES REPS"""
import multiprocessing as mp
import socket
import statistics as st
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/docs/", 1)[0])
TOTAL = 256 << 20


def sender(port):
    from disagg import hostmem

    buf = hostmem.empty(TOTAL).numpy()
    buf.fill(3)
    mv = buf.data
    s = socket.create_connection(("127.0.0.1", port))
    while s.recv(1) == b"g":
        for off in range(0, TOTAL, 1 << 20):
            s.sendall(mv[off : off + (1 << 20)])
    s.close()


def main():
    from disagg import hostmem

    pb, reps = int(sys.argv[1]), int(sys.argv[2])
    n = TOTAL // pb
    flat = hostmem.empty(TOTAL).numpy()
    flat.fill(0)
    pool = hostmem.empty((2 * n, pb)).numpy()
    pool.fill(0)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    p = mp.get_context("spawn").Process(target=sender, args=(srv.getsockname()[1],))
    p.start()
    c, _ = srv.accept()
    rng = np.random.default_rng(1)
    res = {"contiguous": [], "scattered": [], "ascending": []}
    for r in range(reps + 1):
        for mode in res:
            if mode == "contiguous":
                views = [flat.data]
            else:
                slots = rng.permutation(2 * n)[:n]
                if mode == "ascending":
                    slots = np.sort(slots)
                views = [pool[k].data for k in slots.tolist()]
            t = time.perf_counter()
            c.sendall(b"g")
            i, off = 0, 0  # next view, bytes already in it
            while i < len(views):
                batch = [views[i][off:]] + views[i + 1 : i + 1024]
                got = c.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
                while got:
                    take = min(got, len(views[i]) - off)
                    got -= take
                    off += take
                    if off == len(views[i]):
                        i, off = i + 1, 0
            dt = time.perf_counter() - t
            if r:
                res[mode].append(TOTAL / dt / 1e9)
    c.sendall(b"q")
    p.join(10)
    base = st.median(res["contiguous"])
    for mode, xs in res.items():
        print(f"{pb >> 10} KiB {mode:10s} median {st.median(xs):.2f} GB/s "
              f"[{min(xs):.2f}-{max(xs):.2f}] vs contiguous {st.median(xs) / base:.2f}")


if __name__ == "__main__":
    main()
