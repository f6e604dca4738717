"""``disagg bench gpu``: the GPU paths of the connectors, each against its ceiling measured
in the same run (CUDA only; CI has no GPU, so this runs on a lent H200).

- **save** (producer): scattered pages of a device KV pool copied into the block store as
  the connector copies a pass at its end (``producer.saving.copy_ended_pass``: layer by
  layer into a host store, the whole pass at once into a device store): into a pinned host
  store (async staging, landed after the event: ceiling pinned device->host) and into a
  device store (ceiling device->device).
- **load** (consumer): pages from pinned host memory scattered into device page slots with
  ``PagePool.write_pages`` (ceiling pinned host->device).
- **ipc** (same GPU, another process): a producer process's device store opened through
  CUDA IPC, pages gathered from it and scattered into this process's device slots with
  torch's index kernels (ceiling device->device): the medium alone.
- **ipc / ucx / nixl plane** (same GPU, another process): a shipped data plane end to end
  (``transport: ipc``: one Triton copy from the producer's store; ``ucx`` on worker-address
  endpoints: cuda_ipc; ``nixl``: the consumer's NIXL reads, VRAM both sides): post_push in
  the producer process, the consumer's checks, the copy into random slots, the ack. With
  ``--ipc-depths 1,4,8``, that many pushes of ``--total`` bytes each are in flight at once.
- **raw NIXL** (same GPU, another process): the nixl plane's descriptors read with NIXL
  alone (``peers.RawNixl``), the nixl plane's ceiling.

Roles on GPUs (``--producer-device`` / ``--consumer-device``, both ``cuda`` by default):
the save rows and every producer store on the producer's GPU, the load rows and every
pool on the consumer's. Between two GPUs, per page size, two ceilings measured in the
same run (``devices``): ``peer copy`` (one contiguous ``Tensor.copy_`` of ``--total``
bytes across the devices) and ``peer pages`` (the ipc plane's scattered-page kernel on
the consumer's GPU reading the producer's); the plane rows' ceiling is then
``peer_pages``. With both roles on one GPU those rows are that GPU's copy and kernel,
labelled ``(same device)``, and the plane rows keep the ``d2d`` ceiling; every plane
row also carries ``ratio_pages``, its GB/s over the ``peer pages`` row's.

Each figure is the median of ``--repeats`` timed runs after one warm-up (the ipc plane
rows: after ``IPC_WARMUP_PUSHES`` pushes), in GB/s (1e9 B/s).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ..cliargs import Parser, int_list, positive_int, size_list
from ..cliargs import size as byte_size
from . import devices
from .ceilings import cuda_time, gpu_ceilings
from .units import median

# Pushes before the ipc plane rows are timed (see bench_ipc_plane).
IPC_WARMUP_PUSHES = 5


def _pool(n_slots: int, page_bytes: int, layers: int, device: str = "cuda") -> Any:
    """A V1-shaped device pool whose slots are ``page_bytes`` each."""
    import torch

    from ..pages import PagePool

    per = page_bytes // (layers * 2)
    kv = torch.randint(0, 255, (n_slots, layers, 2, per), dtype=torch.uint8, device=device)
    return PagePool.from_v1_tensor(kv, tokens_per_block=16)


def _ipc_owner(q: Any, done: Any, rows: int, page_bytes: int, device: str = "cuda") -> None:
    """Child: a producer's device store, shared with the parent through CUDA IPC."""
    import torch

    torch.cuda.set_device(devices.index(device))
    store = torch.randint(0, 255, (rows, page_bytes), dtype=torch.uint8, device=device)
    q.put(store)
    done.wait()


# plane rows through NIXL: kind -> its UCX error handling (``nixl_error_handling``)
NIXL_KINDS = {"nixl": "peer", "nixl-none": "none"}


def _make_plane(kind: str, bind: str = "tcp://127.0.0.1:0") -> Any:
    if kind == "ucx":  # worker-address endpoints: UCX picks cuda_ipc on one node
        from ..transport.ucx.plane import UcxDataPlane

        return UcxDataPlane(channel="shm", cuda=True)
    if kind in NIXL_KINDS:
        from ..transport.nixl.plane import NixlDataPlane

        return NixlDataPlane(error_handling=NIXL_KINDS[kind])
    from ..transport.ipc import IpcDataPlane

    return IpcDataPlane(bind)


def _plane_producer(
    kind: str, q: Any, go: Any, out: Any, rows: int, page_bytes: int, device: str = "cuda"
) -> None:
    """Child: a producer process whose device store (on ``device``) a data plane serves.
    For each round the parent names, it posts ``depth`` pushes of the same pages and
    times the round until the receiver acked them all."""
    import time

    import torch

    from ..transport.dataplane import StoreRows

    torch.cuda.set_device(devices.index(device))
    plane = _make_plane(kind)
    store = plane.register_source(
        torch.randint(0, 255, (rows, page_bytes), dtype=torch.uint8, device=device)
    )
    raw_meta, raw_base = None, 0
    if kind in NIXL_KINDS:  # the raw NIXL row reads the store through an agent of its own
        from ..transport.nixl import agent as nx

        raw = nx.open_agent(
            f"bench-raw-source-{time.monotonic_ns()}", error_handling=NIXL_KINDS[kind]
        )
        dev = int(store.device.index or 0)
        raw.register_memory([(store.data_ptr(), store.numel(), dev, "")], "VRAM")
        raw_meta, raw_base = raw.get_agent_metadata(), store.data_ptr()
    # the store for the parent's byte check (CUDA IPC through torch: mapped at another
    # address there; the raw reads name this process's), the handshake
    q.put((store, plane.source_caps, raw_meta, raw_base))
    endpoint, caps, src_rows, dst_slots, rounds = go.get()
    pages = [(0, StoreRows(store, src_rows, ((0, page_bytes),)), dst_slots)]
    tid, times = 0, []
    try:
        for depth in rounds:
            t0 = time.perf_counter()
            handles = []
            for _ in range(depth):
                tid += 1
                handles.append(plane.post_push(endpoint, tid, 1, b"bench", pages, caps=caps))
            for h in handles:
                if kind == "ipc":
                    st = plane.wait_push(h, 60)
                else:  # DataPlane.wait backs off to 10 ms: a 1 GiB device push is ~1 ms
                    end = time.monotonic() + 60
                    while not (st := plane.poll_push(h)).final and time.monotonic() < end:
                        time.sleep(0.0001)
                if not st.done:
                    raise RuntimeError(f"push {h.transfer_id} failed: {st.error}")
            times.append((depth, time.perf_counter() - t0))
        out.put(("ok", times))
        go.get(timeout=600)  # the parent's checks and raw reads use the store
    except Exception as exc:  # report, never hang the parent
        out.put(("error", repr(exc)))
    finally:
        plane.close()


def bench_ipc_plane(
    page_bytes: int,
    total: int,
    repeats: int,
    ceil: dict[str, float],
    depths: tuple[int, ...],
    bind: str = "tcp://127.0.0.1:0",
    roles: tuple[str, str] = ("cuda", "cuda"),
) -> list[dict[str, Any]]:
    return bench_plane("ipc", page_bytes, total, repeats, ceil, depths, bind, roles)


def bench_plane(
    kind: str,
    page_bytes: int,
    total: int,
    repeats: int,
    ceil: dict[str, float],
    depths: tuple[int, ...],
    bind: str = "tcp://127.0.0.1:0",
    roles: tuple[str, str] = ("cuda", "cuda"),
) -> list[dict[str, Any]]:
    """A data plane (``kind``) between two processes, the producer's store on
    ``roles[0]``, the consumer's pool on ``roles[1]`` (this process's; one GPU by
    default): ``total`` bytes of pages drawn at random from a store twice that size into
    random slots of a pool twice that size, timed from the first post_push to the last
    ack. With depth d, d such pushes are in flight at once (throughput; the receiver
    checks one push while the GPU copies another). Median of ``repeats`` rounds per
    depth after IPC_WARMUP_PUSHES pushes. The ceiling: ``ceil["peer_pages"]`` where the
    roles are on two GPUs, else ``d2d``; ``ratio_pages`` against ``peer_pages`` (when
    measured) either way."""
    import statistics

    import numpy as np
    import torch
    import torch.multiprocessing as mp

    n = max(1, total // page_bytes)
    gen = np.random.default_rng(page_bytes)
    src_rows = gen.permutation(2 * n)[:n]
    dst_slots = gen.permutation(2 * n)[:n]
    producer_dev, consumer_dev = roles
    pool = torch.zeros((2 * n, page_bytes), dtype=torch.uint8, device=consumer_dev)
    plane = _make_plane(kind, bind)
    plane.register_regions([[pool]])
    # Warm-up: the first pushes of a fresh plane run 20-50% slower, easing over 5-10
    # pushes back to back (cold CPU, threads asleep past the spin window); after one
    # warm-up push the median of five still fell inside that transient
    # (docs/design/data-planes.md).
    rounds = [1] * IPC_WARMUP_PUSHES + [d for d in depths for _ in range(repeats)]
    promised = [dst_slots.tolist()]
    for tid in range(1, sum(rounds) + 1):
        plane.expect(tid, 1, b"bench", [n], 300.0, promised)
    ctx = mp.get_context("spawn")
    q, go, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    child = ctx.Process(
        target=_plane_producer,
        args=(kind, q, go, out, 2 * n, page_bytes, producer_dev),
        daemon=True,
    )
    child.start()
    raw_s = None
    try:
        store, source_caps, raw_meta, raw_base = q.get(timeout=120)
        plane.add_source(source_caps)
        go.put((plane.endpoint, plane.capabilities, src_rows, dst_slots, rounds))
        status, times = out.get(timeout=600)
        if status != "ok":
            raise RuntimeError(f"{kind} plane producer: {times}")
        want = store[torch.from_numpy(src_rows).to(store.device)].to(pool.device)
        got = pool[torch.from_numpy(dst_slots).to(pool.device)]
        assert torch.equal(got, want), f"{kind} plane corrupted pages"
        if raw_meta is not None:  # the same descriptors with NIXL alone
            from .peers import RawNixl

            pool.zero_()
            raw = RawNixl(
                pool,
                raw_meta,
                raw_base,
                2 * n,
                remote_mem="VRAM",
                error_handling=NIXL_KINDS[kind],
            )
            raw_s = statistics.median(
                [raw.read(src_rows, dst_slots) for _ in range(repeats + 1)][1:]
            )
            got = pool[torch.from_numpy(dst_slots).to(pool.device)]
            assert torch.equal(got, want), "raw NIXL corrupted pages"
        del store, want, got
    finally:
        plane.close()
        go.put(None)
        child.join(60)
    cross = not devices.same_gpu(producer_dev, consumer_dev)
    name = "peer_pages" if cross else "d2d"

    def row(path: str, gbps: float) -> dict[str, Any]:
        out = {
            "path": path,
            "page_bytes": page_bytes,
            "pages": n,
            "gbps": round(gbps, 2),
            "ceiling": name,
            "ceiling_gbps": round(ceil[name], 2),
            "ratio": round(gbps / ceil[name], 3),
        }
        if "peer_pages" in ceil:
            out["ratio_pages"] = round(gbps / ceil["peer_pages"], 3)
        return out

    rows = []
    for depth in depths:
        seconds = statistics.median(t for d, t in times[IPC_WARMUP_PUSHES:] if d == depth)
        path = f"{kind} plane, {depth} push{'es' if depth > 1 else ''} in flight"
        rows.append(
            row(
                path + (" (unix)" if bind.startswith("ipc://") else ""),
                depth * n * page_bytes / seconds / 1e9,
            )
        )
    if raw_s is not None:
        rows.append(row(f"raw NIXL, the {kind} plane's descriptors", n * page_bytes / raw_s / 1e9))
    return rows


def bench_peer(
    page_bytes: int, total: int, repeats: int, roles: tuple[str, str], ceil: dict[str, float]
) -> list[dict[str, Any]]:
    """The two ceilings between the roles' GPUs at one page size (``devices``): one
    contiguous copy of ``total`` bytes, and ``total`` bytes of scattered pages by the ipc
    plane's kernel. Sets ``ceil["peer_copy"]`` and ``ceil["peer_pages"]``."""
    n = max(1, total // page_bytes)
    where = devices.label(*roles)
    copy = devices.peer_copy_timer(*roles, n * page_bytes)
    pages = devices.peer_pages_timer(*roles, page_bytes, n, seed=page_bytes)
    out = []
    for key, path, timer in (
        ("peer_copy", f"peer copy, contiguous, {where}", copy),
        ("peer_pages", f"peer pages (kernel), {where}", pages),
    ):
        seconds = median([timer() for _ in range(repeats + 1)][1:])
        ceil[key] = gbps = n * page_bytes / seconds / 1e9
        out.append({"path": path, "page_bytes": page_bytes, "pages": n, "gbps": round(gbps, 2)})
    out[1].update(
        ceiling="peer_copy",
        ceiling_gbps=out[0]["gbps"],
        ratio=round(ceil["peer_pages"] / ceil["peer_copy"], 3),
    )
    return out


def bench_page_size(
    page_bytes: int,
    total: int,
    repeats: int,
    layers: int,
    ceil: dict[str, float],
    roles: tuple[str, str] = ("cuda", "cuda"),
) -> list[dict[str, Any]]:
    import torch
    import torch.multiprocessing as mp

    from ..producer.saving import copy_ended_pass, flush_pass, land, plan_pass
    from ..transport.page_copy import copy_indexed

    n = max(1, total // page_bytes)
    producer_dev, consumer_dev = roles
    pool = _pool(2 * n, page_bytes, layers, producer_dev)  # the producer's engine
    page = pool.groups[0].page_bytes
    gen = torch.Generator().manual_seed(page_bytes)
    slots = torch.randperm(2 * n, generator=gen)[:n]  # scattered destination/source slots
    rows = torch.arange(n)
    nbytes = n * page
    out = []

    def row(path: str, seconds: float, ceiling: str) -> None:
        gbps = nbytes / seconds / 1e9
        out.append(
            {
                "path": path,
                "page_bytes": page,
                "pages": n,
                "gbps": round(gbps, 2),
                "ceiling": ceiling,
                "ceiling_gbps": round(ceil[ceiling], 2),
                "ratio": round(gbps / ceil[ceiling], 3),
            }
        )

    def save(slab: torch.Tensor, store_rows: torch.Tensor) -> None:
        # the pass's end with the default save_plan_layers 0, as the connector copies it
        copy = plan_pass(pool, slab, store_rows.numpy(), [slots.numpy()])
        copy_ended_pass(pool, copy, slab, pool.layers)
        flush_pass(copy, slab)
        ev = torch.cuda.Event()
        ev.record()
        ev.synchronize()  # ProducerService.poll waits for this event without blocking
        land(copy, slab)

    with torch.cuda.device(pool.device):  # save: on the producer's GPU
        host_store = torch.empty((n, page), dtype=torch.uint8, pin_memory=True)
        row(
            "save pool->pinned store",
            cuda_time(lambda: save(host_store, rows), repeats),
            "pinned_d2h",
        )
        scattered_rows = torch.randperm(n, generator=gen)  # a store with scattered free rows
        row(
            "save pool->pinned store (rows scattered)",
            cuda_time(lambda: save(host_store, scattered_rows), repeats),
            "pinned_d2h",
        )
        got = host_store.index_select(0, scattered_rows).to(pool.device)
        assert torch.equal(got, pool.read_pages(0, slots)), "scattered save corrupted pages"
        dev_store = torch.empty((n, page), dtype=torch.uint8, device=pool.device)
        row("save pool->device store", cuda_time(lambda: save(dev_store, rows), repeats), "d2d")
        save(host_store, rows)
        # byte check: the store rows hold exactly the pool pages
        want_saved = pool.read_pages(0, slots)
        assert torch.equal(host_store.to(pool.device), want_saved), "save path corrupted pages"

    cross = not devices.same_gpu(producer_dev, consumer_dev)
    if cross:  # the consumer's engine on its own GPU
        del pool
        pool = _pool(2 * n, page_bytes, layers, consumer_dev)
    with torch.cuda.device(pool.device):  # load: on the consumer's GPU
        pages = host_store
        row(
            "load pinned->device slots",
            cuda_time(lambda: pool.write_pages(0, slots, pages), repeats),
            "pinned_h2d",
        )
        assert torch.equal(pool.read_pages(0, slots).cpu(), pages), "load path corrupted pages"

        ctx = mp.get_context("spawn")
        q, done = ctx.Queue(), ctx.Event()
        child = ctx.Process(target=_ipc_owner, args=(q, done, 2 * n, page, producer_dev))
        child.start()
        try:
            remote = q.get(timeout=120)  # the producer's store, mapped through CUDA IPC
            # n rows drawn at random from its 2n into random slots, by the ipc plane's
            # kernel (on the consumer's GPU, reading the producer's over the peer link)
            src_rows = torch.randperm(2 * n, generator=gen)[:n].to(pool.device)
            (region,) = pool.data_plane_groups()[0]
            dst_idx = slots.to(pool.device)
            row(
                "ipc remote store->device slots (kernel)",
                cuda_time(lambda: copy_indexed(region, dst_idx, remote, src_rows), repeats),
                "peer_pages" if cross else "d2d",
            )
            want = remote[src_rows.to(remote.device)].to(pool.device)
            assert torch.equal(pool.read_pages(0, slots), want), "ipc path corrupted pages"
        finally:
            done.set()
            child.join(30)
    return out


def _bind(control: str) -> str:
    """The receiver's bind for ``--ipc-control``."""
    if control == "tcp":
        return "tcp://127.0.0.1:0"
    if control == "unix":
        import os
        import tempfile

        return f"ipc://{tempfile.mkdtemp(prefix='disagg-bench-')}/{os.getpid()}.sock"
    raise SystemExit(f"--ipc-control: {control!r} is not tcp, unix or both")


def _planes(text: str) -> list[str]:
    import argparse

    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("ipc", "ucx", *NIXL_KINDS)]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(
            f"{','.join(bad) or '(none)'}: choose from ipc, ucx, nixl, nixl-none"
        )
    return kinds


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="disagg bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--page-sizes", type=size_list, default="64KiB,256KiB,1MiB,4MiB")
    p.add_argument("--total", type=byte_size, default="1GiB", help="bytes moved per timed run")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument(
        "--layers", type=positive_int, default=8, help="layers per page (save is layer-wise)"
    )
    p.add_argument("--ipc-only", action="store_true", help="only the data plane rows")
    p.add_argument(
        "--planes",
        type=_planes,
        default="ipc",
        help="data plane rows, comma-separated: ipc, ucx, nixl, nixl-none (the nixl plane "
        "with nixl_error_handling: none); ucx needs ucxx, nixl NIXL",
    )
    p.add_argument(
        "--ipc-depths",
        type=int_list,
        default="1,4",
        help="ipc plane rows: pushes in flight at once",
    )
    p.add_argument(
        "--ipc-control",
        choices=("tcp", "unix", "both"),
        default="tcp",
        help="ipc plane control sockets (both: one set of rows each)",
    )
    devices.add_role_devices(p, "cuda")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("disagg bench gpu: no CUDA device here (this benchmark needs a GPU)", file=sys.stderr)
        return 2
    why = devices.problem(args)
    if why is not None:
        p.error(why)
    roles = (devices.explicit(args.producer_device), devices.explicit(args.consumer_device))
    torch.cuda.set_device(devices.index(args.consumer_device))  # this process: the consumer
    cross = devices.peer_problem(*roles)
    if cross is not None:
        print(f"disagg bench gpu: {devices.label(*roles)}: {cross}", file=sys.stderr)
        return 2
    total, sizes = args.total, args.page_sizes
    ceil = gpu_ceilings(total, args.repeats)
    rows: list[dict[str, Any]] = []
    print(
        f"{torch.cuda.get_device_name()}: roles {devices.label(*roles)}; ceilings (GB/s) "
        + ", ".join(f"{k} {v:.1f}" for k, v in ceil.items())
    )
    print(f"{'path':44} {'page':>8} {'GB/s':>8} {'ceiling':>12} {'ratio':>6} {'/pages':>6}")
    for size in sizes:
        found = bench_peer(size, total, args.repeats, roles, ceil)
        if not args.ipc_only:
            found += bench_page_size(size, total, args.repeats, args.layers, ceil, roles)
        depths = tuple(args.ipc_depths)
        for kind in args.planes:
            binds = ["tcp://127.0.0.1:0"]
            if kind == "ipc":
                controls = ("tcp", "unix") if args.ipc_control == "both" else (args.ipc_control,)
                binds = [_bind(c) for c in controls]
            for bind in binds:
                try:
                    found += bench_plane(kind, size, total, args.repeats, ceil, depths, bind, roles)
                except Exception as exc:  # a plane that cannot run (or failed) keeps its row
                    why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
                    found.append({"path": f"{kind} plane", "page_bytes": size, "error": why})
        for r in found:
            rows.append(r)
            print(_line(r))
    if args.json:
        report = {
            "device": torch.cuda.get_device_name(),
            "roles": devices.label(*roles),
            "ceilings": ceil,
            "results": rows,
        }
        print(json.dumps(report))
    return 0


def _line(r: dict[str, Any]) -> str:
    head = f"{r['path']:44} {r['page_bytes'] >> 10:>6}Ki"
    if "error" in r:
        return f"{head} error: {r['error']}"
    ratio = f"{r['ratio']:>6.2f}" if "ratio" in r else f"{'':>6}"
    pages = f"{r['ratio_pages']:>6.2f}" if "ratio_pages" in r else ""
    return f"{head} {r['gbps']:>8.1f} {r.get('ceiling', ''):>12} {ratio} {pages}".rstrip()


if __name__ == "__main__":
    sys.exit(main())
