"""Pushes in parts: a large device push leaves as several messages, so the receiver
checks and launches the first part's copy while the rest are still sent and checked.

When: the receiver's ``capabilities`` say ``parts`` (the sender reads them from
``post_push(caps=...)``), every batch reads device memory, pages are at least
``PARTS_MIN_PAGE_BYTES``, and no earlier push to that receiver is still in flight
(behind others, the receiver's checks overlap copies anyway). How many: by default a
push of ``PARTS_MIN_PAGES`` or more leaves as its first half (at most
``PARTS_FIRST_MAX`` pages) and the rest; ``push_parts`` or ``tuning.ipc_parts``
(``DISAGG_IPC_PARTS``: comma-separated page counts, ``0`` never) give explicit leading
sizes instead. Measurements behind these numbers: docs/design/ipc-plane.md.

Wire: every part is an ``IpcPush`` with ``part`` = 0, 1, ... and ``last`` on the final
one. The receiver takes parts in order (part ``k`` where another is due fails the
transfer by name), waits for earlier parts' device copies together with the last
part's, and only the last part finishes the transfer and is answered. A refused part,
or a push whose last part never comes (sender dead, abort, deadline), is answered only
after the copies of its earlier parts ended: the sender reuses its rows once answered.
"""

from __future__ import annotations

from collections.abc import Sequence

from ... import tuning

PARTS_MIN_PAGES = 12288
PARTS_FIRST_MAX = 8192
PARTS_MIN_PAGE_BYTES = 32 << 10


def parts_setting(push_parts: Sequence[int] | None) -> tuple[int, ...] | None:
    """The leading part sizes: the argument, else ``tuning.ipc_parts``
    (``DISAGG_IPC_PARTS``; 0 or empty: never cut), else None (the default: see
    ``part_sizes``)."""
    if push_parts is None:
        push_parts = tuning.current().ipc_parts
        if push_parts is None:
            return None
    out = tuple(int(n) for n in push_parts)
    if any(n < 0 for n in out):
        raise ValueError(f"push parts must be page counts >= 0, got {out}")
    return () if out in ((), (0,)) else tuple(n for n in out if n > 0)


def part_sizes(total: int, leading: Sequence[int] | None) -> list[int]:
    """Pages per part of a push of ``total`` pages. ``leading`` None (the default): from
    PARTS_MIN_PAGES pages, the first half (at most PARTS_FIRST_MAX) and the rest; fewer
    pages travel whole. Else each leading size in turn while at least twice as many pages
    would remain after it (a short last part would cost more than it overlaps), then the
    rest as the last part."""
    if leading is None:
        if total < PARTS_MIN_PAGES:
            return [total]
        first = min(total - total // 2, PARTS_FIRST_MAX)
        return [first, total - first]
    out, left = [], total
    for n in leading:
        if left < 3 * n:
            break
        out.append(n)
        left -= n
    out.append(left)
    return out


def cut(lengths: Sequence[int], sizes: Sequence[int]) -> list[list[tuple[int, int, int]]]:
    """Batches of ``lengths`` pages laid end to end, cut into parts of ``sizes`` pages:
    per part, its (batch, start, stop) pieces in order (no empty piece)."""
    parts: list[list[tuple[int, int, int]]] = []
    b = at = 0
    for size in sizes:
        piece = []
        while size > 0:
            take = min(size, lengths[b] - at)
            piece.append((b, at, at + take))
            size -= take
            at += take
            if at == lengths[b]:
                b, at = b + 1, 0
        parts.append(piece)
    return parts
