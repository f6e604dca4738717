"""``disagg bench gpu``: the GPU paths of the connectors, each against its ceiling measured
in the same run (CUDA only; CI has no GPU, so this runs on a lent H200).

- **save** (producer): scattered pages of a device KV pool copied layer by layer into the
  block store, with the connector's own code (``producer.saving``): into a pinned host
  store (async staging, landed after the event: ceiling pinned device->host) and into a
  device store (ceiling device->device).
- **load** (consumer): pages from pinned host memory scattered into device page slots with
  ``PagePool.write_pages`` (ceiling pinned host->device).
- **ipc** (same GPU, another process): a producer process's device store opened through
  CUDA IPC, pages gathered from it and scattered into this process's device slots (ceiling
  device->device). This is the medium a same-node plane uses; disagg's shipped data planes
  (ZMQ, UCX) move host memory, so across processes on one GPU they stage through the host.

Each figure is the median of ``--repeats`` timed runs after one warm-up, in GB/s (1e9 B/s).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .ceilings import cuda_time, gpu_ceilings
from .units import parse_size


def _pool(n_slots: int, page_bytes: int, layers: int) -> Any:
    """A V1-shaped device pool whose slots are ``page_bytes`` each."""
    import torch

    from ..pages import PagePool

    per = page_bytes // (layers * 2)
    kv = torch.randint(0, 255, (n_slots, layers, 2, per), dtype=torch.uint8, device="cuda")
    return PagePool.from_v1_tensor(kv, tokens_per_block=16)


def _ipc_owner(q: Any, done: Any, rows: int, page_bytes: int) -> None:
    """Child: a producer's device store, shared with the parent through CUDA IPC."""
    import torch

    store = torch.randint(0, 255, (rows, page_bytes), dtype=torch.uint8, device="cuda")
    q.put(store)
    done.wait()


def bench_page_size(
    page_bytes: int, total: int, repeats: int, layers: int, ceil: dict[str, float]
) -> list[dict[str, Any]]:
    import torch
    import torch.multiprocessing as mp

    from ..pages import gather_rows
    from ..producer.saving import PassCopy, copy_layer_to_store, flush_pass, land

    n = max(1, total // page_bytes)
    pool = _pool(2 * n, page_bytes, layers)
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
        copy = PassCopy(store_rows)
        for layer in range(layers):  # save_kv_layer, once per layer
            copy_layer_to_store(pool, layer, [slots], copy, slab)
        flush_pass(copy, slab)  # wait_for_save
        ev = torch.cuda.Event()
        ev.record()
        ev.synchronize()  # ProducerService.poll waits for this event without blocking
        land(copy, slab)

    host_store = torch.empty((n, page), dtype=torch.uint8, pin_memory=True)
    row("save pool->pinned store", cuda_time(lambda: save(host_store, rows), repeats), "pinned_d2h")
    scattered_rows = torch.randperm(n, generator=gen)  # a store with scattered free rows
    row(
        "save pool->pinned store (rows scattered)",
        cuda_time(lambda: save(host_store, scattered_rows), repeats),
        "pinned_d2h",
    )
    got = host_store.index_select(0, scattered_rows).cuda()
    assert torch.equal(got, pool.read_pages(0, slots)), "scattered save corrupted pages"
    dev_store = torch.empty((n, page), dtype=torch.uint8, device="cuda")
    row("save pool->device store", cuda_time(lambda: save(dev_store, rows), repeats), "d2d")
    save(host_store, rows)
    # byte check: the store rows hold exactly the pool pages
    assert torch.equal(host_store.cuda(), pool.read_pages(0, slots)), "save path corrupted pages"

    pages = host_store
    row(
        "load pinned->device slots",
        cuda_time(lambda: pool.write_pages(0, slots, pages), repeats),
        "pinned_h2d",
    )
    assert torch.equal(pool.read_pages(0, slots).cpu(), pages), "load path corrupted pages"

    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_ipc_owner, args=(q, done, n, page))
    child.start()
    try:
        remote = q.get(timeout=120)  # the producer's store, mapped through CUDA IPC
        src_rows = rows.cuda()
        row(
            "ipc remote store->device slots",
            cuda_time(lambda: pool.write_pages(0, slots, gather_rows(remote, src_rows)), repeats),
            "d2d",
        )
        assert torch.equal(pool.read_pages(0, slots), remote), "ipc path corrupted pages"
    finally:
        done.set()
        child.join(30)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="disagg bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--page-sizes", default="64KiB,256KiB,1MiB,4MiB")
    p.add_argument("--total", default="1GiB", help="bytes moved per timed run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=8, help="layers per page (save is layer-wise)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("disagg bench gpu: no CUDA device here (this benchmark needs a GPU)", file=sys.stderr)
        return 2
    total = parse_size(args.total)
    sizes = [parse_size(s) for s in args.page_sizes.split(",") if s.strip()]
    ceil = gpu_ceilings(total, args.repeats)
    rows: list[dict[str, Any]] = []
    print(
        f"{torch.cuda.get_device_name()}: ceilings (GB/s) "
        + ", ".join(f"{k} {v:.1f}" for k, v in ceil.items())
    )
    print(f"{'path':34} {'page':>8} {'GB/s':>8} {'ceiling':>12} {'ratio':>6}")
    for size in sizes:
        for r in bench_page_size(size, total, args.repeats, args.layers, ceil):
            rows.append(r)
            print(
                f"{r['path']:34} {r['page_bytes'] >> 10:>6}Ki {r['gbps']:>8.1f} "
                f"{r['ceiling']:>12} {r['ratio']:>6.2f}"
            )
    if args.json:
        print(
            json.dumps({"device": torch.cuda.get_device_name(), "ceilings": ceil, "results": rows})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
