"""Spike: which UCX protocol carries contiguous / iov tag sends over a tcp listener endpoint
(error handling on), and how fast, between two processes. Env set by the caller.
usage: proto.py CASE[,CASE] NMSG   CASE: contig | iov64 | iov256"""
import os, sys, time, socket, multiprocessing as mp
import numpy as np

SEG = 2 << 20


def plan(case, rng, store_rows_64k):
    if case == "contig":
        return None
    pb = 64 << 10 if case == "iov64" else 256 << 10
    return pb


def run_rx(port_q, cases, nmsg):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
    import disagg.transport.ucx_plane  # noqa: sets env defaults like the plane
    import ucxx._lib.libucxx as u
    from ucxx._lib.arr import Array
    import json; ctx = u.UCXContext(config_dict={"NET_DEVICES": "lo", **json.loads(os.environ.get("PROTO_CFG", "{}"))}, feature_flags=(u.Feature.TAG, u.Feature.WAKEUP))
    w = u.UCXWorker(ctx)
    eps = []
    lst = u.UCXListener.create(worker=w, port=0, cb_func=lambda cr: eps.append(lst.create_endpoint_from_conn_request(cr, True)))
    port_q.put(lst.port)
    bufs = [np.zeros(SEG, np.uint8) for _ in range(8)]
    total = len(cases) * nmsg
    posted = []
    nxt = 0
    done = 0
    while done < total:
        while nxt < total and len(posted) < 8:
            b = bufs[nxt % 8]
            posted.append(w.tag_recv(Array(b), u.UCXXTag(nxt + 1)))
            nxt += 1
        w.progress()
        while posted and posted[0].completed:
            posted[0].check_error()
            posted.pop(0)
            done += 1
    # tell sender we're done via plain tag
    t = np.zeros(8, np.uint8)
    r = eps[0].tag_send(Array(t), u.UCXXTag(1 << 40))
    while not r.completed:
        w.progress()
    time.sleep(0.2)
    for _ in range(100):
        w.progress()


def main():
    cases = sys.argv[1].split(",")
    nmsg = int(sys.argv[2])
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=run_rx, args=(q, cases, nmsg))
    p.start()
    port = q.get()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
    import disagg.transport.ucx_plane  # noqa
    from disagg.transport import ucx_iov
    from disagg import hostmem
    import ucxx._lib.libucxx as u
    from ucxx._lib.arr import Array
    import json; ctx = u.UCXContext(config_dict={"NET_DEVICES": "lo", **json.loads(os.environ.get("PROTO_CFG", "{}"))}, feature_flags=(u.Feature.TAG, u.Feature.WAKEUP))
    w = u.UCXWorker(ctx)
    ep = u.UCXEndpoint.create(w, "127.0.0.1", port, True)
    assert ucx_iov.available(), ucx_iov.unavailable_reason()
    store = hostmem.empty(512 << 20).numpy()
    store.fill(1)
    rng = np.random.default_rng(0)
    base = store.ctypes.data
    seq = 0
    for case in cases:
        reqs = []
        t0 = time.perf_counter()
        for i in range(nmsg):
            if case == "contig":
                off = int(rng.integers(0, (512 << 20) // SEG)) * SEG
                r = ep.tag_send(Array(store[off:off + SEG]), u.UCXXTag(seq + 1))
            else:
                pb = 64 << 10 if case == "iov64" else 256 << 10
                n = SEG // pb
                rows = rng.choice((512 << 20) // pb, n, replace=False)
                rows = rows[np.argsort(np.abs(np.diff(np.r_[rows, -5])) > 1)] if False else rows
                iov = ucx_iov.iov_entries(base, pb, rows, ((0, pb),))
                r = ucx_iov.tag_send(ep.handle, ucx_iov.IovBuf(iov, SEG, store), seq + 1)
            reqs.append(r)
            seq += 1
            while len(reqs) >= 4:
                w.progress()
                reqs = [x for x in reqs if not x.completed]
        while reqs:
            w.progress()
            reqs = [x for x in reqs if not x.completed]
        dt = time.perf_counter() - t0
        print(f"{case}: {nmsg} x 2 MiB in {dt:.3f}s = {nmsg * SEG / dt / 1e9:.2f} GB/s (sender-side)", flush=True)
    fin = np.zeros(8, np.uint8)
    r = w.tag_recv(Array(fin), u.UCXXTag(1 << 40))
    while not r.completed:
        w.progress()
    p.join()


if __name__ == "__main__":
    main()
