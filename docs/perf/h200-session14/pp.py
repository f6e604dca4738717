"""Session 14 probe: per-push times of the ipc plane's single push (1 GiB of 64 KiB pages,
random rows of a 2n store into random slots of a 2n pool), many pushes back to back,
with optional CPU affinity per process. usage: python pp.py MODE PUSHES [GAP_MS]
MODE: none | split (consumer / producer on disjoint physical cores, one thread each)
      | same (both processes on one set of physical cores)"""
import os, sys, time, statistics
import numpy as np
import torch
import torch.multiprocessing as mp

def cores():
    """one logical CPU per physical core, and their siblings"""
    seen, firsts = set(), []
    for c in sorted(os.sched_getaffinity(0)):
        try:
            sib = open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read().strip()
        except OSError:
            sib = str(c)
        if sib not in seen:
            seen.add(sib); firsts.append((c, sib))
    return firsts

def cpus_for(mode, who):
    cs = cores()
    half = len(cs) // 2
    if mode == "split":
        pick = cs[:half] if who == "consumer" else cs[half:]
        return {c for c, _ in pick}
    if mode == "same":
        return {c for c, _ in cs[:half]}
    return None

def producer(q, go, out, rows, page_bytes, mode):
    s = cpus_for(mode, "producer")
    if s: os.sched_setaffinity(0, s)
    from disagg.transport.dataplane import StoreRows
    from disagg.transport.ipc_plane import IpcDataPlane
    plane = IpcDataPlane()
    store = plane.register_source(torch.randint(0, 255, (rows, page_bytes), dtype=torch.uint8, device="cuda"))
    q.put(store)
    endpoint, src_rows, dst_slots, pushes, gap = go.get()
    pages = [(0, StoreRows(store, src_rows, ((0, page_bytes),)), dst_slots)]
    times = []
    for tid in range(1, pushes + 1):
        t0 = time.perf_counter()
        h = plane.post_push(endpoint, tid, 1, b"bench", pages)
        st = plane.wait_push(h, 60); assert st.done, st.error
        times.append(time.perf_counter() - t0)
        if gap: time.sleep(gap)
        if tid == int(os.environ.get("PAUSE_AT", 0)): time.sleep(float(os.environ.get("PAUSE_MS", 0)) / 1000)
    out.put(times)
    plane.close()

def main():
    mode, pushes = sys.argv[1], int(sys.argv[2])
    gap = float(sys.argv[3]) / 1000 if len(sys.argv) > 3 else 0.0
    s = cpus_for(mode, "consumer")
    if s: os.sched_setaffinity(0, s)
    from disagg.bench.ceilings import d2d_timer
    from disagg.transport.ipc_plane import IpcDataPlane
    page_bytes = int(os.environ.get("PAGE", 64 << 10))
    n = int(os.environ.get("NPAGES", (1 << 30) // page_bytes))
    total = n * page_bytes
    gen = np.random.default_rng(page_bytes)
    src_rows = gen.permutation(2 * n)[:n]; dst_slots = gen.permutation(2 * n)[:n]
    pool = torch.zeros((2 * n, page_bytes), dtype=torch.uint8, device="cuda")
    src = torch.empty(total, dtype=torch.uint8, device="cuda")
    t = d2d_timer(src)  # the ceiling: one contiguous copy of the push's bytes
    d2d = [total / t() / 1e9 for _ in range(7)]
    del src
    plane = IpcDataPlane("tcp://127.0.0.1:0")
    plane.register_regions([[pool]])
    for tid in range(1, pushes + 1):
        plane.expect(tid, 1, b"bench", [n], 300.0, [dst_slots.tolist()])
    ctx = mp.get_context("spawn")
    q, go, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    ch = ctx.Process(target=producer, args=(q, go, out, 2 * n, page_bytes, mode)); ch.start()
    store = q.get(timeout=120)
    go.put((plane.endpoint, src_rows, dst_slots, pushes, gap))
    times = out.get(timeout=600)
    want = store[torch.from_numpy(src_rows).cuda()]
    assert torch.equal(pool[torch.from_numpy(dst_slots).cuda()], want), "corrupt"
    plane.close(); ch.join(30)
    c = statistics.median(d2d)
    us = [1e6 * x for x in times]
    r = lambda xs: total / (statistics.median(xs) / 1e6) / 1e9 / c
    print(f"page={page_bytes} n={n} parts={os.environ.get('DISAGG_IPC_PARTS', 'default')} {mode:5} gap={gap*1e3:.0f}ms d2d={c:.0f}GB/s  bench-view(2-6)={r(us[1:6]):.3f}  "
          f"steady(10-)={r(us[9:]):.3f}  min={total/(min(us)/1e6)/1e9/c:.3f}")
    print("   us:", " ".join(f"{x:.0f}" for x in us))

if __name__ == "__main__":
    main()
