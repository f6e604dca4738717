from typing import Any

def copy_rows(
    dst_ptr: int,
    dst_rows: int,
    dst_stride: int,
    src_ptr: int,
    src_rows: int,
    src_stride: int,
    row_bytes: int,
    src_idx: Any,
    dst_idx: Any,
    threads: int,
) -> None: ...
def copy_runs(
    src_ptr: int,
    src_rows: int,
    src_stride: int,
    runs: Any,
    dst_rows: int,
    src_idx: Any,
    dst_idx: Any,
    threads: int,
) -> None: ...
