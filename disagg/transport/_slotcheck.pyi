from typing import Any

SLOT_OUTSIDE: int
SLOT_NOT_GIVEN: int
SLOT_TWICE: int
ROW_NEGATIVE: int
ROW_BEYOND: int

def check_stage(
    slots: Any,
    rows: Any,
    width: int,
    num_slots: int,
    row_limit: int,
    ok: Any | None,
    written: Any | None,
    out: Any | None,
    rows_at: int,
) -> tuple[int, int, int]: ...
def pack_pair(rows: Any, slots: Any, out_rows: Any, out_slots: Any) -> tuple[bool, int]: ...
