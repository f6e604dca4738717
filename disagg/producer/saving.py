"""The producer's save path, layer by layer: engine pool pages -> block store rows.

Shared by ``ProducerWorker`` (the engine hooks) and ``disagg bench gpu`` (which times this
exact code on a GPU), so the benchmark measures what the connector runs.

The copies are planned once per forward pass (``plan_pass``, before its first copy): the pass's
page slots and store rows move to their devices once, from pinned memory and without the
host waiting (a pageable host->device copy of an index makes the host wait for the stream,
which holds the engine thread behind the GPU at every layer); whether the rows are one run
of consecutive rows is decided there too. A pass copied at its end (``save_plan_layers``
0, after the first token is sent) is copied whole (``copy_pass_to_store``): one indexed
copy per region, one kernel on CUDA, where a layer at a time is dozens of launches between
the pass's end and its pushes (docs/design/first-token.md). Copied during the forward,
each layer only enqueues its copy (``copy_layer_to_store``): one batched gather per buffer
span of the layer, and one copy into the store (a slice copy when the rows are a run,
else one index copy).

Same device (host pool and host store, or device pool and device store): each layer's
bytes go straight into the store rows. Device pool and host store: each layer is gathered
into a device staging buffer laid out like the store rows; after the last layer one
device->host copy moves the whole pass (straight into the rows when they are one run, which
a fresh store gives; else through pinned staging scattered on the host once the copy has
landed). Everything is enqueued on the current stream (the save stream, or the forward
stream), so the engine thread never waits for a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import tuning
from ..pages import PagePool, copy_rows, scatter_rows
from ..transport.page_copy import copy_indexed, one_pass

# The pass's copies are planned and enqueued from the save of this many layers on
# (``tuning.save_plan_layers``); its store rows are reserved at the save of this many
# layers (``tuning.save_reserve_layers``). 0 does either at the pass's end, and with
# ``tuning.save_after_responses`` that end is ``get_finished``, after the first token is
# sent: the reference engine's prefill is close to launch-bound on the H200, so the
# connector's host work during the forward (per-layer copies, index uploads, the
# reservation, and the prefetch's lookups it answers on another thread, contending for the
# GIL) went onto the first token (docs/design/first-token.md). A continuation that comes
# before the reservation wakes the consumer's prefetch, which then claims at once.
PLAN_AFTER_LAYERS = 0
RESERVE_AFTER_LAYERS = 0


def plan_layers() -> int:
    """The layer whose save plans a pass's copies (``tuning.save_plan_layers``; 0: the
    pass's end)."""
    at = tuning.current().save_plan_layers
    return PLAN_AFTER_LAYERS if at is None else at


def reserve_layers() -> int:
    """The layer whose save reserves a pass's store rows (``tuning.save_reserve_layers``;
    0: the pass's end). A producer names it in its ``HelloOk``: a consumer's prefetch
    polls only a producer that holds blocks while the pass runs."""
    at = tuning.current().save_reserve_layers
    return RESERVE_AFTER_LAYERS if at is None else at


@dataclass
class PassCopy:
    """One forward pass's save copies and their index tensors, placed once."""

    rows: torch.Tensor  # host int64: the store row of each saved block
    slots: list[torch.Tensor]  # per group: the page slots, on the pool's device
    run: int | None = None  # the first row when the rows are one run, else None
    rows_dst: torch.Tensor | None = None  # the rows on the store's device (not a run)
    stage: torch.Tensor | None = None  # device [n, block_bytes]: device pool, host store
    pinned: torch.Tensor | None = None  # host staging when the rows are not one run


def plan_pass(
    pool: PagePool, slab: torch.Tensor, rows: np.ndarray, slots_by_group: list[np.ndarray]
) -> PassCopy:
    """Place a pass's indices for its copies (call with the copies' stream current)."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    n = len(rows)
    if n == 0:
        return PassCopy(torch.from_numpy(rows), [])
    copy = PassCopy(torch.from_numpy(rows), [_to(s, pool.device) for s in slots_by_group])
    if n == 1 or bool(np.all(np.diff(rows) == 1)):
        copy.run = int(rows[0])
    if pool.device != slab.device:
        copy.stage = torch.empty((n, slab.shape[1]), dtype=torch.uint8, device=pool.device)
    elif copy.run is None:
        copy.rows_dst = _to(rows, slab.device)
    return copy


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 index on ``device``: a device copy is enqueued from pinned memory."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def copy_layer_to_store(pool: PagePool, layer: int, copy: PassCopy, slab: torch.Tensor) -> None:
    """Enqueue the copy of layer ``layer``'s bytes of the pass's pages toward their rows."""
    if copy.rows.numel() == 0:
        return
    for col, chunk in pool.gather_layer(layer, copy.slots):
        _put(copy, slab, col, chunk)


def copy_pass_to_store(pool: PagePool, copy: PassCopy, slab: torch.Tensor) -> bool:
    """Enqueue the copy of the pass's whole pages, every layer at once, into their rows:
    one indexed copy per region (``page_copy.copy_indexed``: on CUDA one kernel reading
    each page and writing its row, where a layer at a time is a gather and a copy per
    buffer span and layer, dozens of launches; on the host the C row copy). Call once
    every layer of the pass is saved, with the copies' stream current. False where it
    does not apply (pool and store on different devices; CUDA without Triton): copy the
    layers one by one then."""
    if copy.stage is not None or pool.device != slab.device or not one_pass(slab.device):
        return False
    if copy.rows.numel() == 0:
        return True
    rows = copy.rows
    if slab.device.type != "cpu":
        rows = copy.rows_dst if copy.rows_dst is not None else _to(rows.numpy(), slab.device)
    for gi, regions in enumerate(pool.regions):
        slots = copy.slots[gi]
        if slots.numel() == 0:
            continue
        col = pool.page_offsets[gi]  # a group's page is its regions side by side
        for region in regions:
            width = region.shape[1]
            copy_indexed(slab[:, col : col + width], rows, region, slots)
            col += width
    return True


def copy_ended_pass(pool: PagePool, copy: PassCopy, slab: torch.Tensor, layers: list[int]) -> None:
    """At the pass's end, enqueue the copies of its saved ``layers`` not copied yet: the
    whole pass at once where every layer is among them (``copy_pass_to_store``;
    ``tuning.save_whole_pass``), else a layer at a time. The connector and ``disagg bench
    gpu`` both copy a pass through here."""
    whole = tuning.current().save_whole_pass is not False and set(layers) >= set(pool.layers)
    if whole and copy_pass_to_store(pool, copy, slab):
        return
    for layer in layers:
        copy_layer_to_store(pool, layer, copy, slab)


def warm_pass_copy(pool: PagePool, slab: torch.Tensor) -> None:
    """At bring-up, before any block is stored: slot 0's pages copied into store row 0
    the way a pass is, so the copy's kernel is compiled now. Triton compiles a kernel at
    its first launch: in a producer's first request that held the GIL for over a second,
    and its control thread answered no claim or push meanwhile."""
    zero = np.zeros(1, dtype=np.int64)
    copy = plan_pass(pool, slab, zero, [zero] * len(pool.regions))
    if copy_pass_to_store(pool, copy, slab) and slab.device.type == "cuda":
        torch.cuda.synchronize(slab.device)


def _put(copy: PassCopy, slab: torch.Tensor, col: int, chunk: torch.Tensor) -> None:
    """``chunk`` ([n, width] on the pool's device) toward store columns ``col:col+width``
    of the pass's rows (or of its device staging)."""
    n, width = chunk.shape
    if copy.stage is not None:
        copy_rows(copy.stage[:, col : col + width], chunk)
    elif copy.run is not None:
        copy_rows(slab[copy.run : copy.run + n, col : col + width], chunk)
    else:
        assert copy.rows_dst is not None
        scatter_rows(slab[:, col : col + width], copy.rows_dst, chunk)


def flush_pass(copy: PassCopy, slab: torch.Tensor) -> None:
    """After the last layer, on the same stream: one device->host copy of the pass."""
    if copy.stage is None:
        return
    n = copy.rows.numel()
    if copy.run is not None:
        slab[copy.run : copy.run + n].copy_(copy.stage, non_blocking=True)
    else:
        copy.pinned = torch.empty(copy.stage.shape, dtype=torch.uint8, pin_memory=True)
        copy.pinned.copy_(copy.stage, non_blocking=True)


def land(copy: PassCopy, slab: torch.Tensor) -> None:
    """Once the pass's copies have completed: finish on the host, release the staging."""
    if copy.pinned is not None:
        scatter_rows(slab, copy.rows, copy.pinned)
    copy.stage = copy.pinned = None
    copy.slots, copy.rows_dst = [], None
