import msgspec
import pytest

from disagg.protocol import (
    ALL_MESSAGES,
    Claim,
    ClaimOk,
    Error,
    ErrorCode,
    Fingerprint,
    GroupGeometry,
    Heartbeat,
    Hello,
    HelloOk,
    Lookup,
    LookupOk,
    Ok,
    PageBatch,
    ProtocolError,
    Push,
    PushOk,
    Release,
    Removed,
    Renew,
    RenewOk,
    SnapshotOk,
    SnapshotRequest,
    Stored,
    TransferDone,
    decode,
    encode,
    raise_if_error,
)

K = [bytes([i]) * 16 for i in range(3)]
FP = Fingerprint(
    model="m",
    dtype="bf16",
    tokens_per_block=16,
    groups=[GroupGeometry(0, None, 4096, 2), GroupGeometry(1, 128, 4096, 2)],
)

SAMPLES = [
    Hello(instance_id="c1", role="consumer", fingerprint=FP, data_endpoint="tcp://x:1"),
    HelloOk(instance_id="p1", fingerprint=FP, data_endpoint="tcp://y:2", transport="ucx"),
    Ok(),
    Error(code=int(ErrorCode.BUSY), message="later"),
    Lookup(owner="c1", keys=K),
    LookupOk(num_blocks=2),
    Claim(owner="c1", request_id="r", keys=K, ttl_s=5.0),
    ClaimOk(lease_id=9, num_blocks=3, ttl_s=5.0),
    Renew(owner="c1", lease_ids=[1, 2]),
    RenewOk(unknown=[2]),
    Release(owner="c1", lease_id=1),
    Push(
        owner="c1",
        lease_id=1,
        transfer_id=5,
        data_endpoint="tcp://z:3",
        first_block=1,
        num_blocks=2,
        dst_slots=[[3, 4], [-1, 7]],
        token=b"secret",
    ),
    PushOk(transfer_id=5),
    Heartbeat(owner="c1"),
    Stored(producer="p", seq=1, keys=K),
    Removed(producer="p", seq=2, keys=K[:1]),
    SnapshotRequest(),
    SnapshotOk(producer="p", seq=2, keys=K),
    PageBatch(transfer_id=5, lease_id=1, token=b"t", group=1, runs=[(0, 2), (7, 1)], page_bytes=64),
    TransferDone(transfer_id=5, token=b"t", checksum=(1 << 64) - 1),
]


def test_every_message_has_a_sample():
    assert {type(s) for s in SAMPLES} == set(ALL_MESSAGES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def raw(**fields):
    return msgspec.msgpack.encode(fields)


def code_of(data, **kw):
    with pytest.raises(ProtocolError) as ei:
        decode(data, **kw)
    assert ei.value.code.name in str(ei.value)
    return ei.value.code


def test_truncated_and_garbage():
    data = encode(SAMPLES[11])
    for cut in (1, 5, len(data) // 2, len(data) - 1):
        assert code_of(data[:cut]) == ErrorCode.BAD_FRAME
    assert code_of(b"") == ErrorCode.BAD_FRAME
    assert code_of(b"\xc1") == ErrorCode.BAD_FRAME
    assert code_of(msgspec.msgpack.encode([1, 2])) == ErrorCode.BAD_FRAME
    assert code_of(raw(v=1)) == ErrorCode.BAD_FRAME  # no kind


def test_unknown_kind_and_version():
    assert code_of(raw(kind="nope", v=1)) == ErrorCode.UNKNOWN_KIND
    assert code_of(raw(kind="ok", v=2)) == ErrorCode.BAD_VERSION
    # a future version's unknown kind is reported as a version problem
    assert code_of(raw(kind="future", v=7)) == ErrorCode.BAD_VERSION


def test_bad_fields_name_the_path():
    with pytest.raises(ProtocolError) as ei:
        decode(raw(kind="lookup", v=1, owner="c", keys=[b"short"]))
    assert ei.value.code == ErrorCode.BAD_FIELD and "keys[0]" in ei.value.message
    assert code_of(raw(kind="lookup", v=1, owner=3, keys=[])) == ErrorCode.BAD_FIELD
    assert code_of(raw(kind="lookup", v=1, keys=[])) == ErrorCode.BAD_FIELD  # missing
    assert code_of(raw(kind="claim_ok", v=1, lease_id=-1, num_blocks=0, ttl_s=1.0)) == (
        ErrorCode.BAD_FIELD
    )
    bad_push = dict(
        kind="push", v=1, owner="c", lease_id=1, transfer_id=1, data_endpoint="e", first_block=0
    )
    assert code_of(raw(**bad_push, num_blocks=2, dst_slots=[[1]])) == ErrorCode.BAD_FIELD
    assert code_of(raw(**bad_push, num_blocks=1, dst_slots=[[-2]])) == ErrorCode.BAD_FIELD
    pb = dict(kind="pages", v=1, transfer_id=1, lease_id=1, token=b"", group=0, page_bytes=8)
    assert code_of(raw(**pb, runs=[[-1, 1]])) == ErrorCode.BAD_FIELD
    assert code_of(raw(**pb, runs=[[0, 0]])) == ErrorCode.BAD_FIELD
    assert code_of(raw(**pb, runs=[])) == ErrorCode.BAD_FIELD


def test_oversize():
    msg = Lookup(owner="c", keys=K * 1000)
    data = encode(msg)
    assert code_of(data, max_bytes=len(data) - 1) == ErrorCode.TOO_LARGE
    assert decode(data, max_bytes=len(data)) == msg


def test_error_helpers():
    with pytest.raises(ProtocolError) as ei:
        raise_if_error(Error(code=int(ErrorCode.UNKNOWN_LEASE), message="lease 4"))
    assert ei.value.code == ErrorCode.UNKNOWN_LEASE
    assert str(ei.value) == "UNKNOWN_LEASE: lease 4"
    assert ProtocolError(9999, "x").code == ErrorCode.INTERNAL
    assert raise_if_error(Ok()) == Ok()


def test_push_validates_on_construction():
    with pytest.raises(ValueError):
        Push(
            owner="c",
            lease_id=1,
            transfer_id=1,
            data_endpoint="e",
            first_block=0,
            num_blocks=2,
            dst_slots=[[1]],
        )
