"""Parts-aware push timeline (session 10). usage: DEV=cuda python tl2.py PAGE_BYTES N REPS
Per push: first launch time after post_push start, GPU kernel time per part, GPU bubbles
between parts (CUDA events), receiver CPU per part, TOTAL. One clock: perf_counter."""
import os, sys, time, statistics
import numpy as np
import torch
import multiprocessing as mp

DEV = os.environ.get("DEV", "cuda")
now = time.perf_counter

class Z:
    def elapsed_time(self, o): return float("nan")

def producer(q, go, out, rows, page_bytes):
    from disagg.transport import ipc_plane as ip
    from disagg.transport.dataplane import StoreRows
    rec = {}
    o_post, o_fin = ip.IpcDataPlane.post_push, ip.PushHandle.finish
    def post(self, ep, tid, *a, **k):
        t = now(); h = o_post(self, ep, tid, *a, **k); rec.setdefault(tid, {}).update(p0=t, p1=now()); return h
    def fin(self, *a, **k):
        rec.setdefault(self.transfer_id, {})["p3"] = now(); return o_fin(self, *a, **k)
    ip.IpcDataPlane.post_push, ip.PushHandle.finish = post, fin
    plane = ip.IpcDataPlane()
    store = plane.register_source(torch.randint(0, 255, (rows, page_bytes), dtype=torch.uint8, device=DEV))
    q.put(store)
    endpoint, src_rows, dst_slots, reps = go.get()
    pages = [(0, StoreRows(store, src_rows, ((0, page_bytes),)), dst_slots)]
    for tid in range(1, reps + 1):
        h = plane.post_push(endpoint, tid, 1, b"bench", pages)
        st = plane.wait_push(h, 60); assert st.done, st.error
        rec[tid]["p4"] = now()
        time.sleep(float(os.environ.get("GAP", "0")))
    out.put(rec)
    plane.close()

def main():
    page_bytes, n, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    from disagg.transport import ipc_plane as ip
    rec, ev = {}, {}
    o_push, o_copy, o_plan = ip.IpcDataPlane._rx_push, ip._copy, ip.IpcDataPlane._plan
    cur = {}
    def push(self, m, conn):
        cur["k"] = (m.transfer_id, m.part)
        r = rec.setdefault(cur["k"], {}); r["c1"] = now()
        out = o_push(self, m, conn); r["c4"] = now(); return out
    def plan(self, rx, m):
        out = o_plan(self, rx, m); rec[cur["k"]]["c2"] = now(); return out
    def copy(plan):
        if DEV != "cuda":
            rec[cur["k"]]["c25"] = now(); out = o_copy(plan); rec[cur["k"]]["c3"] = now(); ev[cur["k"]] = (Z(), Z()); return out
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        s = torch.cuda.current_stream()
        rec[cur["k"]]["c25"] = now()
        a.record(s); out = o_copy(plan); b.record(s)
        rec[cur["k"]]["c3"] = now(); ev[cur["k"]] = (a, b)
        return out
    ip.IpcDataPlane._rx_push, ip._copy, ip.IpcDataPlane._plan = push, copy, plan
    gen = np.random.default_rng(1)
    src_rows = gen.permutation(2 * n)[:n]; dst_slots = gen.permutation(2 * n)[:n]
    pool = torch.zeros((2 * n, page_bytes), dtype=torch.uint8, device=DEV)
    plane = ip.IpcDataPlane()
    plane.register_regions([[pool]])
    for tid in range(1, reps + 1):
        plane.expect(tid, 1, b"bench", [n], 300.0, [dst_slots.tolist()])
    ctx = mp.get_context("spawn")
    q, go, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    ch = ctx.Process(target=producer, args=(q, go, out, 2 * n, page_bytes)); ch.start()
    store = q.get(timeout=120)
    go.put((plane.endpoint, src_rows, dst_slots, reps))
    prec = out.get(timeout=600)
    DEV == 'cuda' and torch.cuda.synchronize()
    want = store[torch.from_numpy(src_rows).to(store.device)]
    assert torch.equal(pool[torch.from_numpy(dst_slots).to(DEV)], want), "corrupt"
    plane.close(); ch.join(30)
    tids = list(range(4, reps + 1))
    nparts = max(p for (t, p) in rec if t == tids[0]) + 1
    def med(xs): xs = [x for x in xs if x == x]; return statistics.median(xs) if xs else float("nan")
    print(f"== parts={os.environ.get('DISAGG_IPC_PARTS','default')} page_bytes={page_bytes} n={n} reps={len(tids)} parts/push={nparts}")
    print(f"  post_push            {med([1e6*(prec[t]['p1']-prec[t]['p0']) for t in tids]):8.1f} us")
    for p in range(nparts):
        k = lambda t: (t, p)
        arr = med([1e6*(rec[k(t)]['c1']-prec[t]['p0']) for t in tids])
        pl = med([1e6*(rec[k(t)]['c2']-rec[k(t)]['c1']) for t in tids])
        pre = med([1e6*(rec[k(t)]['c25']-rec[k(t)]['c2']) for t in tids])
        la = med([1e6*(rec[k(t)]['c3']-rec[k(t)]['c25']) for t in tids])
        tail = med([1e6*(rec[k(t)]['c4']-rec[k(t)]['c3']) for t in tids])
        gpu = med([1e3*ev[k(t)][0].elapsed_time(ev[k(t)][1]) for t in tids])
        bub = med([1e3*ev[(t, p-1)][1].elapsed_time(ev[k(t)][0]) for t in tids]) if p else float("nan")
        print(f"  part {p}: arrives {arr:7.1f}  plan {pl:6.1f}  pre-copy {pre:5.1f}  launch {la:6.1f}  after {tail:5.1f}  | gpu {gpu:6.1f}  bubble before {bub:6.1f}")
    first = med([1e6*(rec[(t,0)]['c3']-prec[t]['p0']) for t in tids])
    gpu_all = med([1e3*ev[(t,0)][0].elapsed_time(ev[(t,nparts-1)][1]) for t in tids])
    tot = med([1e6*(prec[t]['p4']-prec[t]['p0']) for t in tids])
    ack = med([1e6*(prec[t]['p4']-prec[t]['p3']) for t in tids])
    print("  per push TOTAL (us):", " ".join(f"{1e6*(prec[t]['p4']-prec[t]['p0']):.0f}" for t in range(1, reps + 1)))
    print(f"  first launch done at {first:.1f}; gpu first start->last end {gpu_all:.1f}; finish->wait returns {ack:.1f}; TOTAL {tot:.1f} us = {n*page_bytes/tot/1e3:.0f} GB/s")

if __name__ == "__main__":
    main()
