"""In-pair A/B of the UCX tcp plane: one producer and one consumer process, each holding
one plane per UCX config (A: today's defaults; H: hardened; H64: hardened +
UCX_TCP_MAX_IOV=64), pushes of N random 2N-store rows into random slots alternating modes
and a raw TCP stream (1 MiB sendall, like ceilings.socket_gbps) in between.
Modes: A (ring), B (H, ring), C (H, iov 2 MiB segs), C64 (H64, iov 2 MiB), raw;
R64 (H64, iov sends, and the consumer receives packed segments as iov receives straight
into the slots, ``tcp_iov_recvs``; every other mode receives into scratch + C row copy);
P64 (session 12: R64 with runs up to 2 MiB packed instead of sent alone from 1 MiB, what
``iovrx=1`` now asks for; both processes' module constant switched per push).
(C16, iov in 16 MiB segments, was measured with a since-removed patch that made the
sender ignore the receiver's seg=2m.)
usage: inpair.py PAGE_BYTES ROUNDS MODES..."""
import os, sys, time, socket, statistics as st, multiprocessing as mp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
TOTAL = 256 << 20
HARD = dict(UCX_TCP_PUT_ENABLE="n", UCX_RNDV_SCHEME="am", UCX_TCP_TX_SEG_SIZE="2m",
            UCX_TCP_RX_SEG_SIZE="2m")
CFGS = {"A": {"UCX_RNDV_SCHEME": "put_zcopy"}, "H": HARD, "H64": dict(HARD, UCX_TCP_MAX_IOV="64")}
MODE_CFG = {"A": "A", "B": "H", "C": "H", "C64": "H64", "R64": "H64", "P64": "H64"}
KEYS = ["UCX_TCP_PUT_ENABLE", "UCX_RNDV_SCHEME", "UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE",
        "UCX_TCP_MAX_IOV"]


def planes(cfgs):
    from disagg.transport.ucx_plane import UcxDataPlane
    out = {}
    for name in cfgs:
        for k in KEYS:
            os.environ.pop(k, None)
        os.environ.update(CFGS[name])
        p = UcxDataPlane(channel="tcp")
        out[name] = p
    for k in KEYS:
        os.environ.pop(k, None)
    os.environ["UCX_RNDV_SCHEME"] = "put_zcopy"
    return out


RAW = {}


def raw_send(port, nbytes, reps):
    if "s" not in RAW:
        RAW["s"] = socket.create_connection(("127.0.0.1", port))
        RAW["buf"] = np.ones(nbytes, np.uint8)
    s, mv = RAW["s"], RAW["buf"].data
    for _ in range(reps):
        s.recv(1)
        for off in range(0, nbytes, 1 << 20):
            s.sendall(mv[off:off + (1 << 20)])


def producer(pb, conn, cfgs):
    import torch
    from disagg import hostmem
    from disagg.transport.dataplane import push_source
    ps = planes(cfgs)
    n = TOTAL // pb
    store = hostmem.empty((2 * n, pb)).numpy()
    store.fill(7)
    store[:, :8] = np.arange(2 * n, dtype=np.int64).view(np.uint8).reshape(2 * n, 8)
    rows = torch.from_numpy(store)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "raw":
            raw_send(msg[1], TOTAL, 1)
            conn.send("ok")
            continue
        _, mode, endpoint, tid, src, dst = msg
        p = ps[MODE_CFG[mode]]
        p.tcp_iov_sends = mode[0] in "CRP"  # normally decided once, from the context
        import disagg.transport.ucx_plane as U
        U.DIRECT_MIN = (2 << 20) + 1 if mode == "P64" else 1 << 20  # P64: runs <= 2 MiB packed
        before = p.stats["iov_sends"]
        c0 = time.process_time()
        pages = [(0, *push_source(p, rows, src, ((0, pb),), dst))]
        h = p.post_push(endpoint, tid, 1, b"bench", pages, deadline_s=300)
        s = p.wait_push(h, 300)
        conn.send((s.error, p.stats["iov_sends"] - before, time.process_time() - c0))
    for p in ps.values():
        p.close()


def main():
    pb = int(sys.argv[1]); rounds = int(sys.argv[2]); modes = sys.argv[3:]
    cfgs = sorted({MODE_CFG[m] for m in modes if m != "raw"})
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    pr = ctx.Process(target=producer, args=(pb, a, cfgs))
    pr.start()
    import torch
    from disagg import hostmem
    ps = planes(cfgs)
    n = TOTAL // pb
    pool = hostmem.empty((2 * n, pb))
    pool.fill_(0)
    for p in ps.values():
        p.register_regions([[pool]])
    assert b.recv() == "ready"
    if os.environ.get("INPAIR_GC") == "off":  # is a slow transfer a garbage collection?
        import gc
        gc.disable()
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    dstbuf = np.zeros(TOTAL, np.uint8); mv = dstbuf.data
    rng = np.random.default_rng(int(os.environ.get("INPAIR_SEED", "1")))
    res = {m: [] for m in modes}
    cpu = {m: [] for m in modes}  # (consumer, producer) CPU seconds per GB, all threads
    tid = 0
    raw_c = None
    for r in range(rounds + 1):  # round 0: warm-up
        order = modes if r % 2 else modes[::-1]
        for mode in order:
            t0 = time.perf_counter()
            if mode == "raw":
                b.send(("raw", srv.getsockname()[1]))
                if raw_c is None:
                    raw_c, _ = srv.accept()
                c = raw_c
                t0 = time.perf_counter()
                c.sendall(b"g")
                got = 0
                while got < TOTAL:
                    got += c.recv_into(mv[got:], TOTAL - got)
                dt = time.perf_counter() - t0
                assert b.recv() == "ok"
            else:
                tid += 1
                p = ps[MODE_CFG[mode]]
                src = rng.permutation(2 * n)[:n].astype(np.int64)
                dst = rng.permutation(2 * n)[:n].astype(np.int64)
                p.tcp_iov_recvs = mode[0] in "RP"  # normally decided once
                p._direct_min = (2 << 20) + 1 if mode == "P64" else 1 << 20
                rb = p.stats["iov_recvs"]
                p.expect(tid, 1, b"bench", [n], 300)
                c0 = time.process_time()
                t0 = time.perf_counter()
                b.send(("push", mode, p.endpoint, tid, src, dst))
                while True:
                    s = p.poll(tid)
                    if s.final:
                        break
                    time.sleep(0.0002)
                dt = time.perf_counter() - t0
                ccpu = time.process_time() - c0
                err, iovs, pcpu = b.recv()
                if r:
                    cpu[mode].append((ccpu / TOTAL * 1e9, pcpu / TOTAL * 1e9))
                assert s.done, (s.error, err)
                assert (iovs > 0) == (mode[0] in "CRP") or pb >= (1 << 20), (mode, iovs)
                assert (p.stats["iov_recvs"] > rb) == (mode[0] in "RP") or pb >= (1 << 20), (mode, p.stats)
                got = pool.numpy()[dst, :8].copy().view(np.int64).reshape(-1)
                assert np.array_equal(got, src)
            if r:
                res[mode].append(TOTAL / dt / 1e9)
    b.send(("stop",))
    pr.join(30)
    for p in ps.values():
        p.close()
    raw = st.median(res["raw"]) if "raw" in res else None
    for m in modes:
        xs = res[m]
        print(f"pb={pb>>10}KiB {m:4s} median {st.median(xs):.2f} GB/s [{min(xs):.2f}-{max(xs):.2f}]"
              + (f" ratio {st.median(xs)/raw:.2f}" if raw else "")
            + (f" cpu s/GB consumer {st.median(c for c, _ in cpu[m]):.3f}"
               f" producer {st.median(q for _, q in cpu[m]):.3f}" if cpu[m] else "")
            + (f"\n    runs {' '.join(f'{x:.2f}' for x in xs)}" if os.environ.get("INPAIR_RUNS") else ""),
            flush=True)


if __name__ == "__main__":
    main()
