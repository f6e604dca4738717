"""Steady loop of one mode for profiling (session 12): ``zmq`` (the zmq tcp plane: N
random 64 KiB store rows into N random slots, like the bench) or ``zmqpoll`` (the same,
the consumer polling every 1 ms instead of waiting on the book's condition), ``ucx``
(session 13: the same through the UCX plane's tcp channel), or ``raw``
(the bench's raw TCP ceiling: 256 MiB streamed producer -> consumer into a hugepage buffer).
Prints GB/s (median) and each process's user/sys CPU seconds per GB, so two runs show
which side spends more per byte than the ceiling. usage: zloop.py PAGE ROUNDS MODE"""
import multiprocessing as mp
import os
import socket
import statistics as st
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/docs/", 1)[0])
TOTAL = 256 << 20


def make_plane(mode):
    if mode == "ucx":
        from disagg.transport.ucx_plane import UcxDataPlane
        return UcxDataPlane(channel="tcp")
    from disagg.transport.zmq_plane import ZmqDataPlane
    return ZmqDataPlane("tcp://127.0.0.1:0")


def cpu():
    t = os.times()
    return t.user, t.system


def producer(pb, mode, conn):
    import torch

    from disagg import hostmem
    from disagg.transport.dataplane import push_source
    n = TOTAL // pb
    store = hostmem.empty((2 * n, pb)).numpy()
    store.fill(5)
    if mode == "raw":
        port = conn.recv()
        s = socket.create_connection(("127.0.0.1", port))
        mv = store.reshape(-1)[:TOTAL].data
        conn.send("ready")
        c0 = cpu()
        while s.recv(1) == b"g":
            for off in range(0, TOTAL, 1 << 20):
                s.sendall(mv[off : off + (1 << 20)])
        c1 = cpu()
        conn.send((c1[0] - c0[0], c1[1] - c0[1]))
        return
    plane = make_plane(mode)
    rows = torch.from_numpy(store)
    conn.send("ready")
    c0 = None
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "mark":
            c0 = cpu()
            continue
        _, ep, tid, src, dst = msg
        pages = [(0, *push_source(plane, rows, src, ((0, pb),), dst))]
        h = plane.post_push(ep, tid, 1, b"z", pages, deadline_s=300)
        conn.send(plane.wait_push(h, 300).error)
    c1 = cpu()
    conn.send((c1[0] - c0[0], c1[1] - c0[1]))
    plane.close()


def main():
    from disagg import hostmem

    pb, rounds, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    n = TOTAL // pb
    a, b = mp.get_context("spawn").Pipe()
    p = mp.get_context("spawn").Process(target=producer, args=(pb, mode, a))
    p.start()
    res = []
    if mode == "raw":
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        b.send(srv.getsockname()[1])
        c, _ = srv.accept()
        assert b.recv() == "ready"
        buf = hostmem.empty(TOTAL).numpy()
        buf.fill(0)
        mv = buf.data
        for r in range(rounds + 1):
            if r == 1:
                c0 = cpu()
            t = time.perf_counter()
            c.sendall(b"g")
            got = 0
            while got < TOTAL:
                got += c.recv_into(mv[got:], TOTAL - got)
            if r:
                res.append(TOTAL / (time.perf_counter() - t) / 1e9)
        c1 = cpu()
        c.sendall(b"q")
    else:
        plane = make_plane(mode)
        pool = hostmem.empty((2 * n, pb))
        pool.fill_(0)
        plane.register_regions([[pool]])
        assert b.recv() == "ready"
        rng = np.random.default_rng(1)
        for r in range(rounds + 1):
            if r == 1:
                c0 = cpu()
                b.send(("mark",))
            src = rng.permutation(2 * n)[:n].astype(np.int64)
            dst = rng.permutation(2 * n)[:n].astype(np.int64)
            plane.expect(r + 1, 1, b"z", [n], 300)
            t = time.perf_counter()
            b.send(("push", plane.endpoint, r + 1, src, dst))
            if mode == "zmqpoll":  # nobody waits on the book's condition: no wake-ups
                while not (st_ := plane.poll(r + 1)).final:
                    time.sleep(0.001)
            else:
                st_ = plane.wait(r + 1, 300)
            dt = time.perf_counter() - t
            assert st_.done, st_.error
            assert b.recv() is None
            if r:
                res.append(TOTAL / dt / 1e9)
        c1 = cpu()
        b.send(("stop",))
    pc = b.recv()
    p.join(10)
    gb = rounds * TOTAL / 1e9
    print(f"{mode} {pb >> 10} KiB median {st.median(res):.2f} GB/s [{min(res):.2f}-{max(res):.2f}]"
          f" consumer user/sys s/GB {(c1[0] - c0[0]) / gb:.3f}/{(c1[1] - c0[1]) / gb:.3f}"
          f" producer {pc[0] / gb:.3f}/{pc[1] / gb:.3f}")


if __name__ == "__main__":
    main()
