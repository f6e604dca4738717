# Spike (session 12): after an abort with iov receives in flight, close the accepted endpoints through ucxx on the
# progress thread. FC_MODE=blocking (close_blocking: a forced close, ucxx lets go of the handle) ends them and the plane
# closes; FC_MODE=nb (close(): a request) leaves them running. Run from the repo root.
import ctypes, os, sys, time, signal, multiprocessing as mp
sys.path.insert(0, "/work/main/tests/transport"); sys.path.insert(0, "/work/main/tests")
import numpy as np, torch
import test_ucx_iovrecv as t

def recv(q_out, q_in):
    os.environ["DISAGG_UCX_TCP_IOV_RECV"] = "1"
    from disagg.transport import ucx_iov
    from disagg.transport.ucx_plane import UcxDataPlane
    plane = UcxDataPlane(channel="tcp"); plane.abort_wait_s = 1.0
    pool = torch.zeros(t.BIG, t.PB, dtype=torch.uint8); plane.register_regions([[pool]])
    q_out.put(plane.endpoint); plane.expect(1, 3, b"tok", [t.BIG], 60); q_out.put("expecting")
    while plane.poll(1).pages == 0: time.sleep(0.0005)
    q_out.put("landing"); assert q_in.get(timeout=60) == "stopped"
    left = plane.abort(1, "x"); rx = plane._book.rx[1]
    lib = ucx_iov._load().lib if hasattr(ucx_iov, "_load") else None
    res = {}
    mode = os.environ.get("FC_MODE", "blocking")
    def job():
        res["alive"] = [ep.alive for ep in plane._accepted]
        for ep in plane._accepted:
            if mode == "blocking":
                ep.close_blocking()
            else:
                ep.close()
        res["reqs"] = mode
    plane._submit(job)
    t0 = time.monotonic()
    while rx.inflight and time.monotonic() - t0 < 5: time.sleep(0.01)
    after = pool.numpy().copy()
    q_out.put(("aborted", left, rx.inflight, time.monotonic() - t0, str(res.get("reqs"))))
    assert q_in.get(timeout=60) == "resumed"
    time.sleep(1.0)
    q_out.put(("quiet", bool(np.array_equal(after, pool.numpy())), rx.inflight))
    q_in.get(timeout=60)
    plane.close(); import gc; del plane; gc.collect(); q_out.put("closed ok")

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q_r, q_s, q_in, q_go = (ctx.Queue() for _ in range(4))
    r = ctx.Process(target=recv, args=(q_r, q_in)); r.start()
    ep = q_r.get(timeout=30)
    rows1 = np.random.default_rng(3).permutation(2 * t.SLOTS * 16)[:t.BIG] % (2 * t.SLOTS)
    dst = np.random.default_rng(4).permutation(t.BIG)
    s = ctx.Process(target=t._sender, args=(ep, [(1, rows1.tolist(), dst.tolist(), 1)], q_s, q_go)); s.start()
    assert q_r.get(timeout=30) == "expecting"; q_go.put(None)
    assert q_r.get(timeout=60) == "landing"
    os.kill(s.pid, signal.SIGSTOP); q_in.put("stopped")
    print(q_r.get(timeout=60), flush=True)
    os.kill(s.pid, signal.SIGCONT); q_in.put("resumed")
    print(q_r.get(timeout=60), flush=True)
    q_in.put(None); print(q_r.get(timeout=60), flush=True); q_go.put(None); q_go.put(None)
    r.join(10); s.join(10); print("exit codes", r.exitcode, s.exitcode)
    for p in (r, s):
        if p.is_alive(): p.kill()
