"""Fencing a load whose pages the engine handed to another request while it landed.

No stored TensorRT-LLM executor keeps a cancelled request's pages while its load is
pending: ``_handle_canceled_requests`` frees them at once, calls no connector hook (no
``request_finished``), and the next iteration may allocate them to another request. The
consumer cannot rely on the executor, so it watches the allocations themselves. Every page
a forward will read or write reaches the leader's scheduler before that forward runs:

- ``update_state_after_alloc``: every request's first allocation, parked ones included;
- ``build_connector_meta``: every scheduled request's new pages (``new_block_ids``, per
  layer group where the line passes groups) with its ``computed_position``.

``Fence.check`` compares them with the destination slots of the loads of *other* requests
that may still write (DISPATCHED; PLANNED; TP > 1 also LANDED here but not yet on every
rank). A hit means the load's request is gone. Its verdict, applied before this pass's
``start_load_kv``:

- **fenced**: the other request writes the page (a fresh page, or its own load's
  destination). The load is aborted on this rank at once and on every other rank by this
  pass's metadata (``dropped``); after the plane's abort no byte of it lands (a plane whose
  abort cannot prove that gets no async loads: ``metadata.loads_async``).
- **awaited**: the other request reads the page as a cached prefix (a block ordinal below
  its computed position: V1 with block reuse stored the ended request's blocks). The bytes
  landing are the ones it reads, so aborting would serve half a page; instead every rank
  waits for the load before this pass's loads and forward (``AwaitedLoad``), bounded by the
  load's deadline. If it fails, the readers fail by the failure policy (on V1 with block
  reuse the instance stops: the page stays published).

A load both fenced and awaited in one pass is fenced, and its readers fail before dispatch.
Block ids are compared per layer group (each group's pool has its own slots), vectorised.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .loads import Load, LoadState


class Fence:
    """The leader's collection of this pass's hits (see the module docstring)."""

    def __init__(self) -> None:
        self.fenced: dict[int, int] = {}  # load's request id -> a request that writes its pages
        self.awaited: dict[int, set[int]] = {}  # load's request id -> requests reading them

    @staticmethod
    def pending(loads: Iterable[Load], tp: bool) -> list[Load]:
        """Loads that may still write a page: in flight, planned, or (TP > 1) landed here
        but not yet known landed on every rank."""
        out = []
        for load in loads:
            if load.dst_slots is None:
                continue
            st = load.state
            if st in (LoadState.DISPATCHED, LoadState.PLANNED) or (tp and st is LoadState.LANDED):
                out.append(load)
        return out

    def check(
        self,
        request_id: int,
        block_ids_by_group: Sequence[Sequence[int]],
        reads_below: int,
        pending: Sequence[Load],
    ) -> None:
        """Record the hits of request ``request_id``'s pages (``block_ids_by_group[g][i]``:
        block ordinal ``i`` of group g; ordinals below ``reads_below`` are read as a cached
        prefix, the rest written) on the slots of ``pending`` loads of other requests."""
        others = [ld for ld in pending if ld.request_id != request_id]
        if not others:
            return
        for g, ids in enumerate(block_ids_by_group):
            if not len(ids):
                continue
            mine = np.asarray(ids, dtype=np.int64)
            for load in others:
                dst = load.dst_slots
                if dst is None or g >= len(dst):
                    continue
                theirs = np.asarray(dst[g], dtype=np.int64)
                hit = np.isin(mine, theirs[theirs >= 0])
                hit &= mine >= 0
                if not hit.any():
                    continue
                ordinals = np.flatnonzero(hit)
                rid = load.request_id
                if (ordinals >= reads_below).any():
                    self.fenced.setdefault(rid, request_id)
                if (ordinals < reads_below).any():
                    self.awaited.setdefault(rid, set()).add(request_id)

    def check_output(self, scheduler_output: Any, tokens_per_block: int, pending: Sequence[Load]):
        """Every scheduled request's new pages in a ``SchedulerOutput``: a request reported
        for the first time reads the blocks below its ``computed_position``; a request
        reported before only grows into fresh pages."""
        first = [(rd, True) for rd in scheduler_output.new_requests]
        later = [(rd, False) for rd in scheduler_output.cached_requests]
        for rd, is_new in first + later:
            groups = getattr(rd, "new_block_ids_by_layer_group", None)
            if isinstance(groups, dict):
                groups = [groups[g] for g in sorted(groups)]
            if not groups:
                groups = [rd.new_block_ids]
            reads = int(rd.computed_position) // tokens_per_block if is_new else 0
            self.check(rd.request_id, groups, reads, pending)

    def take(self) -> tuple[dict[int, int], dict[int, set[int]]]:
        """This pass's verdicts (fenced wins over awaited), cleared."""
        fenced, awaited = self.fenced, self.awaited
        self.fenced, self.awaited = {}, {}
        return fenced, awaited
