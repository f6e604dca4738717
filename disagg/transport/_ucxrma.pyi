def post(
    fn: int,
    ep: int,
    rkey: int,
    param: int,
    local: int,
    remote: int,
    length: int,
    n: int,
    reqs: int,
) -> tuple[int, int, int]: ...
def drive(
    progress: int, worker: int, check: int, free: int, reqs: int, n: int, start: int, rounds: int
) -> tuple[int, int]: ...
