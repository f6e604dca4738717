"""The compatibility fingerprint peers exchange in Hello / HelloOk.

Two instances may exchange pages only when every field that changes what a page's bytes
mean is equal. `check_compatible` names the first field that differs.

Where both state the model's KV head count (``num_kv_heads`` > 0), pages move by KV head
between any TP sizes (``engine.heads``): TP size and rank are not compared, and each
group's ``bytes_per_page`` is the whole model's page (every KV head, as at TP = 1), so it
is the same on every rank of every TP size. Otherwise (an older or head-blind peer) a TP
shard is served only to the same rank of the same TP size.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .errors import ErrorCode, ProtocolError
from .version import MAX_GROUPS, MAX_STR

_NonNeg = Annotated[int, msgspec.Meta(ge=0)]
_Pos = Annotated[int, msgspec.Meta(ge=1)]
_Str = Annotated[str, msgspec.Meta(max_length=MAX_STR)]


class GroupGeometry(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One layer group: `window` is the attention window in tokens (None or 0 = full)."""

    group_id: _NonNeg
    window: _NonNeg | None
    bytes_per_page: _Pos
    num_layers: _NonNeg


class Fingerprint(msgspec.Struct, frozen=True):
    """What must match between producer and consumer for pages to be interchangeable."""

    model: _Str
    dtype: _Str
    tokens_per_block: _Pos
    groups: Annotated[list[GroupGeometry], msgspec.Meta(max_length=MAX_GROUPS)]
    tp_size: _Pos = 1
    tp_rank: _NonNeg = 0
    num_kv_heads: _NonNeg = 0  # the model's, every rank's together; 0: not stated


_HINTS = {
    "model": "serve the same model checkpoint on both roles",
    "dtype": "set the same KV cache dtype on both roles",
    "tokens_per_block": "set the same tokens_per_block on both roles",
    "tp_size": "use the same tensor-parallel size on both roles",
    "tp_rank": "pair each consumer rank with the producer rank of the same index",
    "num_kv_heads": "serve the same model checkpoint on both roles",
}

_HEAD_BLIND = (
    "both roles must state the model's KV head count to pair TP shards (the same disagg "
    "version, and a model config that names it, or num_kv_heads in the disagg config)"
)


def _window(w: int | None) -> int:
    return w or 0  # None and 0 both mean "full attention"


def check_compatible(mine: Fingerprint, theirs: Fingerprint) -> None:
    """Return None when pages can move between the two; else raise
    ProtocolError(INCOMPATIBLE_PEER, "peer's <field> is X but ours is Y: <fix hint>")."""

    def fail(field: str, their: object, our: object, hint: str) -> None:
        raise ProtocolError(
            ErrorCode.INCOMPATIBLE_PEER, f"peer's {field} is {their!r} but ours is {our!r}: {hint}"
        )

    for field in ("model", "dtype", "tokens_per_block"):
        if getattr(mine, field) != getattr(theirs, field):
            fail(field, getattr(theirs, field), getattr(mine, field), _HINTS[field])
    by_heads = mine.num_kv_heads > 0 and theirs.num_kv_heads > 0
    if mine.num_kv_heads != theirs.num_kv_heads:
        hint = _HINTS["num_kv_heads"] if by_heads else _HEAD_BLIND
        fail("num_kv_heads", theirs.num_kv_heads, mine.num_kv_heads, hint)
    if not by_heads:  # shards pair by rank only
        for field in ("tp_size", "tp_rank"):
            if getattr(mine, field) != getattr(theirs, field):
                fail(field, getattr(theirs, field), getattr(mine, field), _HINTS[field])
    if len(mine.groups) != len(theirs.groups):
        fail(
            "number of layer groups",
            len(theirs.groups),
            len(mine.groups),
            "both roles need the same attention windows (VSWA config) and layer count",
        )
    for i, (a, b) in enumerate(zip(mine.groups, theirs.groups, strict=True)):
        for field, x, y in (
            ("group_id", a.group_id, b.group_id),
            ("window", _window(a.window), _window(b.window)),
            ("bytes_per_page", a.bytes_per_page, b.bytes_per_page),
            ("num_layers", a.num_layers, b.num_layers),
        ):
            if x != y:
                fail(
                    f"groups[{i}].{field}",
                    y,
                    x,
                    "layer groups must match (same model config, KV dtype and windows)",
                )
