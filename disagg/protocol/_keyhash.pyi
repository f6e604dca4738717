from collections.abc import Callable

from _typeshed import ReadableBuffer

def pack_int64(tokens: list[int] | tuple[int, ...], start: int, stop: int, /) -> bytes: ...
def chain_digests(
    digest: Callable[[bytes], bytes],
    prev: ReadableBuffer,
    data: ReadableBuffer,
    block_bytes: int,
    /,
) -> bytes: ...
