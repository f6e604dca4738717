def drive(
    progress: int, worker: int, check: int, free: int, reqs: int, n: int, start: int, rounds: int
) -> tuple[int, int]: ...
def pull(
    fn: int,
    ep: int,
    rkey: int,
    param: int,
    local: int,
    remote: int,
    length: int,
    n: int,
    cursor: int,
    slice: int,
    max_bytes: int,
    progress: int,
    worker: int,
    check: int,
    free: int,
    reqs: int,
    nreqs: int,
    start: int,
) -> tuple[int, int, int, int, int]: ...
def guard_cma(push: int, /) -> bool: ...
def cma_failures() -> tuple[int, str]: ...
def cma_log_test(dispatch: int, comp: int, file: str, /) -> None: ...
