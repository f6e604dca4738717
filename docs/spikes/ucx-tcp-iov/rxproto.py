"""Spike: what UCX does for a tag receive with an IOV destination (ucp_tag_msg_recv_nbx
after a probe with remove, as the plane receives) over a tcp listener endpoint (error
handling on), and how fast, between two processes. UCX env set by the caller.
usage: rxproto.py CASE[,CASE] NMSG   CASE: contig | iov64 | iov256 (receiver's buffer)"""
import ctypes, os, sys, time, multiprocessing as mp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
SEG = 2 << 20
POOL = 512 << 20


def msg_recv_fn():
    from disagg.transport import ucx_iov
    lib = ucx_iov.load()
    assert lib is not None, ucx_iov.unavailable_reason()
    f = lib.lib.ucp_tag_msg_recv_nbx
    f.restype = ctypes.c_void_p
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
    return lib, f


def run_rx(port_q, cases, nmsg):
    import disagg.transport.ucx_plane  # noqa: env defaults like the plane
    from disagg import hostmem
    from disagg.transport import ucx_iov
    import ucxx._lib.libucxx as u
    from ucxx._lib.arr import Array
    ctx = u.UCXContext(config_dict={"NET_DEVICES": "lo"}, feature_flags=(u.Feature.TAG, u.Feature.WAKEUP))
    w = u.UCXWorker(ctx)
    eps = []
    lst = u.UCXListener.create(worker=w, port=0, cb_func=lambda cr: eps.append(lst.create_endpoint_from_conn_request(cr, True)))
    port_q.put(lst.port)
    lib, recv = msg_recv_fn()
    pool = hostmem.empty(POOL).numpy(); pool.fill(0)
    base = pool.ctypes.data
    rng = np.random.default_rng(2)
    contig = [np.zeros(SEG, np.uint8) for _ in range(8)]
    for case in cases:
        posted = []  # (kind, req/ptr, keep)
        done = 0
        t0 = None
        while done < nmsg:
            pr = w.tag_probe(u.UCXXTag(0), u.UCXXTagMask(0), remove=True)
            if pr.matched:
                if t0 is None:
                    t0 = time.perf_counter()
                assert int(pr.length) == SEG
                if case == "contig":
                    posted.append(("u", w.tag_recv_with_handle(Array(contig[done % 8]), pr), None))
                else:
                    pb = 64 << 10 if case == "iov64" else 256 << 10
                    rows = rng.choice(POOL // pb, SEG // pb, replace=False)
                    iov = ucx_iov.iov_entries(base, pb, rows, ((0, pb),))
                    p = recv(w.handle, iov.ctypes.data, iov.shape[0], pr.handle, lib.iov_param_ref)
                    assert p is None or p < ucx_iov._PTR_ERR_MIN, p
                    posted.append(("r", p, iov))
            w.progress()
            left = []
            for kind, r, keep in posted:
                if kind == "u":
                    if r.completed:
                        r.check_error(); done += 1
                    else:
                        left.append((kind, r, keep))
                else:
                    st = 0 if r is None else int(lib.lib.ucp_request_check_status(r))
                    if st == 1:
                        left.append((kind, r, keep))
                    else:
                        if r is not None:
                            lib.lib.ucp_request_free(r)
                        assert st == 0, st
                        done += 1
            posted = left
        dt = time.perf_counter() - t0
        print(f"rx {case}: {nmsg} x 2 MiB in {dt:.3f}s = {nmsg * SEG / dt / 1e9:.2f} GB/s", flush=True)
    t = np.zeros(8, np.uint8)
    r = eps[0].tag_send(Array(t), u.UCXXTag(1 << 40))
    while not r.completed:
        w.progress()
    time.sleep(0.2)
    for _ in range(100):
        w.progress()
    # destroy the worker here (a forked child exits without destructors): UCX_PROTO_INFO
    # prints the receiver's table when its worker goes
    del r, eps[:], lst
    del w, ctx
    import gc; gc.collect()


def main():
    cases = sys.argv[1].split(",")
    nmsg = int(sys.argv[2])
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=run_rx, args=(q, cases, nmsg))
    p.start()
    port = q.get()
    import disagg.transport.ucx_plane  # noqa
    from disagg import hostmem
    import ucxx._lib.libucxx as u
    from ucxx._lib.arr import Array
    ctx = u.UCXContext(config_dict={"NET_DEVICES": "lo"}, feature_flags=(u.Feature.TAG, u.Feature.WAKEUP))
    w = u.UCXWorker(ctx)
    ep = u.UCXEndpoint.create(w, "127.0.0.1", port, True)
    src = hostmem.empty(64 << 20).numpy(); src.fill(1)
    seq = 0
    for case in cases:
        reqs = []
        for i in range(nmsg):
            off = (i % 32) * SEG
            reqs.append(ep.tag_send(Array(src[off:off + SEG]), u.UCXXTag((1 << 63) | (seq + 1))))
            seq += 1
            while len(reqs) >= 4:
                w.progress()
                reqs = [x for x in reqs if not x.completed]
        while reqs:
            w.progress()
            reqs = [x for x in reqs if not x.completed]
    fin = np.zeros(8, np.uint8)
    r = w.tag_recv(Array(fin), u.UCXXTag(1 << 40))
    while not r.completed:
        w.progress()
    p.join()


if __name__ == "__main__":
    main()
