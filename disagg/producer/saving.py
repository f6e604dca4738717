"""The producer's save path, layer by layer: engine pool pages -> block store rows.

Shared by ``ProducerWorker`` (the engine hooks) and ``disagg bench gpu`` (which times this
exact code on a GPU), so the benchmark measures what the connector runs.

Same device (host pool and host store, or device pool and device store): each layer's
bytes are gathered and scattered straight into the store rows. Device pool and host
store: each layer is gathered into a device staging buffer laid out like the store rows;
after the last layer one device->host copy moves the whole pass (straight into the rows
when they are one run, which a fresh store gives; else through pinned staging scattered
on the host once the copy has landed). Everything is enqueued on the forward stream, so
the engine thread never waits for a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..pages import PagePool, _is_run, copy_rows, scatter_rows


@dataclass
class PassCopy:
    """One forward pass's save copies."""

    rows: torch.Tensor  # host int64: the store row of each saved block
    stage: torch.Tensor | None = None  # device [n, block_bytes]: device pool, host store
    pinned: torch.Tensor | None = None  # host staging when the rows are not one run


def copy_layer_to_store(
    pool: PagePool,
    layer: int,
    slots_by_group: list[torch.Tensor],
    copy: PassCopy,
    slab: torch.Tensor,
) -> None:
    """Copy layer ``layer``'s bytes of the pass's page slots toward their store rows."""
    for col, chunk in pool.gather_layer(layer, slots_by_group):
        width = chunk.shape[1]
        if chunk.device == slab.device:
            scatter_rows(slab[:, col : col + width], copy.rows, chunk)
            continue
        if copy.stage is None:
            copy.stage = torch.empty(
                (copy.rows.numel(), slab.shape[1]), dtype=torch.uint8, device=chunk.device
            )
        copy_rows(copy.stage[:, col : col + width], chunk)


def flush_pass(copy: PassCopy, slab: torch.Tensor) -> None:
    """After the last layer, on the same stream: one device->host copy of the pass."""
    if copy.stage is None:
        return
    n = copy.rows.numel()
    if _is_run(copy.rows):
        start = int(copy.rows[0])
        slab[start : start + n].copy_(copy.stage, non_blocking=True)
    else:
        copy.pinned = torch.empty(copy.stage.shape, dtype=torch.uint8, pin_memory=True)
        copy.pinned.copy_(copy.stage, non_blocking=True)


def land(copy: PassCopy, slab: torch.Tensor) -> None:
    """Once the pass's event has fired: finish on the host, release the device staging."""
    if copy.pinned is not None:
        scatter_rows(slab, copy.rows, copy.pinned)
    copy.stage = copy.pinned = None
