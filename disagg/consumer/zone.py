"""The landing zone: consumer-owned memory a prefetched lease's pages land in before the
continuation exists, copied into the engine's pages when it does.

The engine allocates pages only for a request it admitted, so a push cannot start into
them while the producer still prefills. The zone is a byte budget of this consumer's own
(``consumer.landing_zone_size``, on ``consumer.landing_zone_device``: null, the engine's
KV cache device), one ``[slots, page_bytes]`` slab per layer group, registered on the
consumer's data plane after the engine's groups (from ``base``). A push into it is an
ordinary ``Push`` whose ``group_base`` names those groups: no protocol change, and the
producer neither knows nor cares that it is not the engine's pool.

Contract:
- ``fill`` (the prefetch's thread, once its lease is granted): reserves one zone slot per
  leased block (none free: ``zone_full``, the lease stays a plain one), expects the
  transfer and asks the producer to push; the fill rides on the lease (``Claimed.zone``);
- a load whose lease carries a fill is dispatched without a push (``dispatch``); it is
  DISPATCHED until the fill's transfer is DONE, under the load's own deadline and states;
  ``copy_in`` (the engine's thread, under the service's load lock, only for a load still
  DISPATCHED: an ABANDONED one never copies) then writes zone -> engine pages, one
  scattered row copy per page region (``page_copy.copy_indexed``: one kernel on CUDA, on a
  stream of the zone's, waited for before the load is LANDED, as the data plane's own
  copies are before DONE), so the pages hold their bytes for any stream that reads them;
- ``drop`` (whenever the lease is released: taken, expired, abandoned, failed over) aborts
  a fill not final yet (the plane's bounded abort: after it no byte of it lands) and frees
  its slots; slots the abort could not quiet are never reused (``zone_slots_stuck``);
- a fill not taken is dropped with its lease at ``prefetch.PREFETCH_HOLD_S``; its
  transfer's own deadline is ``ZONE_FILL_S`` past the hold plus ``load_timeout_s``.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..config.errors import err
from ..pages import PagePool
from ..protocol import messages as m
from ..protocol.version import PROTOCOL_VERSION
from ..transport.page_copy import copy_indexed
from .host import LinkHost
from .loads import Claimed, Load, LoadState
from .prefetch import PREFETCH_HOLD_S

log = logging.getLogger("disagg.consumer")

# a fill's transfer deadline past the prefetch's hold (``PREFETCH_HOLD_S``, which drops a
# fill no continuation took) and the load's own ``load_timeout_s``
ZONE_FILL_S = PREFETCH_HOLD_S


class ZoneHost(LinkHost, Protocol):
    data: Any  # the data plane (``DataPlane``)

    def next_transfer_id(self) -> int: ...


@dataclass
class Fill:
    """One prefetched lease's pages in the zone: ``slots[i]`` holds lease block ``i``."""

    slots: np.ndarray  # int64, one zone slot per leased block
    transfer_id: int
    token: bytes


def zone_device(value: str | None, pool_device: torch.device) -> str:
    """The zone's torch device for ``consumer.landing_zone_device`` (null: the engine's
    KV cache device); ConfigError naming the field otherwise."""
    from ..config import store_device_for

    if value is None:
        return str(pool_device)
    return store_device_for(value, pool_device, field="consumer.landing_zone_device")


class LandingZone:
    """Zone slots for prefetched pages: allocation, fills, the copy out, the release."""

    def __init__(self, svc: ZoneHost, pool: PagePool, budget_bytes: int, device: str | None):
        self.svc, self.pool = svc, pool
        block = pool.block_bytes
        capacity = budget_bytes // block if block else 0
        if capacity < 1:
            raise err(
                "consumer.landing_zone_size",
                f"is {budget_bytes} B, which holds no block of {block} B (one page of every "
                f"layer group): raise it to at least {block} B, or 0 to turn the zone off",
            )
        dev = zone_device(device, pool.device)
        pin = dev == "pinned" and torch.cuda.is_available()
        where = "cpu" if dev == "pinned" else dev
        try:  # after the engine's KV cache: out of what the engine left
            self.slabs = [
                torch.empty((capacity, g.page_bytes), dtype=torch.uint8, device=where)
                for g in pool.groups
            ]
            if pin:
                self.slabs = [s.pin_memory() for s in self.slabs]
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            raise err(
                "consumer.landing_zone_size",
                f"{budget_bytes} B could not be allocated on {dev} ({exc}); lower it, or "
                "put the zone elsewhere (consumer.landing_zone_device)",
            ) from exc
        self.capacity = capacity
        self.base = 0  # the zone's first data-plane group (``register``)
        self._lock = threading.Lock()
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # a stack, low slots on top
        cuda = pool.device.type == "cuda" or self.slabs[0].is_cuda
        self._stream = torch.cuda.Stream(pool.device) if cuda else None  # the copies'
        # where each page region's bytes sit in a zone row: (region, column)
        self._cols = [
            list(zip(regions, np.cumsum([0, *g.region_sizes[:-1]]).tolist(), strict=True))
            for regions, g in zip(pool.regions, pool.groups, strict=True)
        ]

    def groups(self, base: int) -> list[list[torch.Tensor]]:
        """The zone's data-plane groups (one region each), registered from ``base``."""
        self.base = base
        return [[s] for s in self.slabs]

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    # -- slots ----------------------------------------------------------------------------
    def _allocate(self, n: int) -> np.ndarray | None:
        with self._lock:
            if n > len(self._free):
                return None
            got = self._free[-n:]
            del self._free[-n:]
        return np.asarray(got[::-1], dtype=np.int64)

    # -- fills (the prefetch's thread) ----------------------------------------------------
    def fill(self, claimed: Claimed) -> bool:
        """Have ``claimed``'s blocks pushed into zone slots now; False (nothing started,
        the lease unchanged) when the zone is full or the push is refused."""
        svc, n = self.svc, claimed.num_blocks
        slots = self._allocate(n)
        if slots is None:
            svc.metrics["zone_full"] += 1
            return False
        fill = Fill(slots, svc.next_transfer_id(), secrets.token_bytes(16))
        groups = len(self.slabs)
        listed = slots.tolist()
        try:
            svc.data.expect(
                fill.transfer_id,
                claimed.lease_id,
                fill.token,
                [0] * self.base + [n] * groups,
                ZONE_FILL_S + svc.ccfg.load_timeout_s,
                slots_by_group=[*([] for _ in range(self.base)), *([listed] * groups)],
            )
        except Exception as exc:
            log.warning("landing zone: the data plane refused a fill: %s", exc)
            self._free_slots(slots)
            return False
        claimed.zone = fill
        push = m.Push(
            v=PROTOCOL_VERSION,
            owner=svc.owner,
            lease_id=claimed.lease_id,
            transfer_id=fill.transfer_id,
            token=fill.token,
            data_endpoint=svc.data.endpoint,
            data_caps=svc.data.capabilities,
            first_block=0,
            num_blocks=n,
            dst_slots=[listed] * groups,
            incarnation=claimed.incarnation,
            group_base=self.base,
        )
        try:
            svc._call(claimed.link, push, background=True)
        except Exception as exc:  # the lease stays; the load pushes into pages as before
            log.info("landing zone: push to %s refused: %s", claimed.link.endpoint, exc)
            self.drop(claimed)
            return False
        svc.metrics["zone_fills"] += 1
        return True

    def state(self, claimed: Claimed) -> Any:
        """The fill's transfer status (``TransferStatus``)."""
        assert claimed.zone is not None
        return self.svc.data.poll(claimed.zone.transfer_id)

    # -- the load (the engine's thread) ---------------------------------------------------
    def dispatch(self, load: Load, lock: Any) -> None:
        """PLANNED -> DISPATCHED without a push: the load waits for its lease's fill
        (``transfer_id``; an empty ``token`` marks it as the zone's) within its deadline."""
        assert load.claimed.zone is not None
        with lock:  # the service's load lock
            load.transition(LoadState.DISPATCHED)
            load.transfer_id, load.token = load.claimed.zone.transfer_id, b""
            load.deadline = time.monotonic() + self.svc.ccfg.load_timeout_s

    def copy_in(self, load: Load) -> None:
        """Zone -> the load's engine pages (its fill landed; the load still DISPATCHED,
        under the service's load lock): one scattered row copy per page region, done (or,
        on CUDA, waited for) when this returns."""
        fill = load.claimed.zone
        if fill is None:  # its slots were freed: they may hold another fill's bytes now
            raise RuntimeError("its landing-zone fill was dropped before the copy")
        assert load.dst_slots is not None and load.state is LoadState.DISPATCHED
        src_all = fill.slots[load.push_first : load.push_first + load.blocks]
        pages = 0
        stream = self._stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for g, dst in enumerate(load.dst_slots):
                d = np.asarray(dst, dtype=np.int64)
                keep = d >= 0
                if not keep.any():
                    continue
                d_idx = torch.from_numpy(d[keep])
                self.pool.check_slots(g, d_idx)
                s_idx = torch.from_numpy(src_all[keep])
                slab = self.slabs[g]
                for region, col in self._cols[g]:
                    copy_indexed(region, d_idx, slab[:, col : col + region.shape[1]], s_idx)
                pages += int(keep.sum())
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
        if stream is not None:
            done.synchronize()  # a device-local copy: the pages hold their bytes from here
        self.svc.metrics["zone_pages_copied"] += pages
        self.svc.metrics["zone_loads"] += 1

    def drop(self, claimed: Claimed) -> None:
        """The lease is released (or moves off the zone): abort its fill if it may still
        write, then free its slots (never reused if the abort could not quiet them)."""
        with self._lock:
            fill, claimed.zone = claimed.zone, None
        if fill is None:
            return
        data = self.svc.data
        try:
            final = data.poll(fill.transfer_id).final
        except KeyError:
            final = True  # long forgotten: nothing of it writes any more
        if not final and data.abort(fill.transfer_id, "the landing zone dropped the fill"):
            self.svc.metrics["zone_slots_stuck"] += len(fill.slots)
            log.error(
                "landing zone: fill %d still had writes under way after its abort: its %d "
                "slot(s) are never reused",
                fill.transfer_id,
                len(fill.slots),
            )
            return
        self._free_slots(fill.slots)

    def _free_slots(self, slots: np.ndarray) -> None:
        with self._lock:
            self._free.extend(slots[::-1].tolist())
