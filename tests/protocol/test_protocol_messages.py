import msgspec
import pytest

from disagg.protocol import (
    ALL_MESSAGES,
    KEY_BYTES,
    MAX_CONTROL_FRAME,
    PROTOCOL_VERSION,
    Claim,
    ClaimOk,
    Error,
    ErrorCode,
    Fingerprint,
    GroupGeometry,
    Heartbeat,
    Hello,
    HelloOk,
    KeyBlob,
    Lookup,
    LookupOk,
    Ok,
    PageBatch,
    ProtocolError,
    Push,
    PushOk,
    Release,
    ReleaseRange,
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
V = PROTOCOL_VERSION
FP = Fingerprint(
    model="m",
    dtype="bf16",
    tokens_per_block=16,
    groups=[GroupGeometry(0, None, 4096, 2), GroupGeometry(1, 128, 4096, 2)],
)

SAMPLES = [
    Hello(instance_id="c1", role="consumer", fingerprint=FP, data_endpoint="tcp://x:1"),
    HelloOk(instance_id="p1", fingerprint=FP, data_endpoint="tcp://y:2", transport="ucx"),
    HelloOk(instance_id="p1", fingerprint=FP, features=["release_range"]),
    Ok(),
    Error(code=int(ErrorCode.BUSY), message="later"),
    Lookup(owner="c1", keys=K),
    LookupOk(num_blocks=2),
    Claim(owner="c1", request_id="r", keys=K, ttl_s=5.0),
    ClaimOk(lease_id=9, num_blocks=3, ttl_s=5.0),
    Renew(owner="c1", lease_ids=[1, 2]),
    RenewOk(unknown=[2]),
    Release(owner="c1", lease_id=1),
    ReleaseRange(owner="c1", lease_id=1, first_block=2, num_blocks=3),
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


def test_release_range_is_refused_by_name_by_an_older_peer():
    """A peer built before ``release_range`` refuses the kind by name (never misreads it as
    something else), and its HelloOk (no ``features``) announces nothing, so a consumer
    does not send it one."""
    from disagg.protocol.messages import decode_with

    old = [c for c in ALL_MESSAGES if c is not ReleaseRange]
    old_union = msgspec.msgpack.Decoder(__import__("typing").Union[tuple(old)])
    old_kinds = {c.__struct_config__.tag for c in old}
    frame = encode(ReleaseRange(owner="c1", lease_id=1, first_block=0, num_blocks=1))
    with pytest.raises(ProtocolError) as ei:
        decode_with(old_union, old_kinds, frame, MAX_CONTROL_FRAME)
    assert ei.value.code is ErrorCode.UNKNOWN_KIND and "'release_range'" in ei.value.message
    older_ok = msgspec.msgpack.encode(
        {"kind": "hello_ok", "v": V, "instance_id": "p", "fingerprint": FP}
    )
    assert decode(older_ok).features == []
    # a release of nothing is refused, naming the field
    bad = raw(kind="release_range", v=V, owner="c", lease_id=1, first_block=0, num_blocks=0)
    assert code_of(bad) is ErrorCode.BAD_FIELD


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
    assert code_of(raw(v=V)) == ErrorCode.BAD_FRAME  # no kind


def test_unknown_kind_and_version():
    assert code_of(raw(kind="nope", v=V)) == ErrorCode.UNKNOWN_KIND
    assert code_of(raw(kind="ok", v=V + 1)) == ErrorCode.BAD_VERSION
    # a future version's unknown kind is reported as a version problem
    assert code_of(raw(kind="future", v=7)) == ErrorCode.BAD_VERSION


def test_bad_fields_name_the_path():
    with pytest.raises(ProtocolError) as ei:
        decode(raw(kind="stored", v=V, producer="p", seq=1, keys=[b"short"]))
    assert ei.value.code == ErrorCode.BAD_FIELD and "keys[0]" in ei.value.message
    assert code_of(raw(kind="lookup", v=V, owner=3, keys=b"")) == ErrorCode.BAD_FIELD
    assert code_of(raw(kind="lookup", v=V, keys=b"")) == ErrorCode.BAD_FIELD  # missing
    assert code_of(raw(kind="claim_ok", v=V, lease_id=-1, num_blocks=0, ttl_s=1.0)) == (
        ErrorCode.BAD_FIELD
    )
    bad_push = dict(
        kind="push", v=V, owner="c", lease_id=1, transfer_id=1, data_endpoint="e", first_block=0
    )
    assert code_of(raw(**bad_push, num_blocks=2, dst_slots=[[1]])) == ErrorCode.BAD_FIELD
    assert code_of(raw(**bad_push, num_blocks=1, dst_slots=[[-2]])) == ErrorCode.BAD_FIELD
    pb = dict(kind="pages", v=V, transfer_id=1, lease_id=1, token=b"", group=0, page_bytes=8)
    assert code_of(raw(**pb, runs=[[-1, 1]])) == ErrorCode.BAD_FIELD
    assert code_of(raw(**pb, runs=[[0, 0]])) == ErrorCode.BAD_FIELD
    assert code_of(raw(**pb, runs=[])) == ErrorCode.BAD_FIELD


@pytest.mark.parametrize("kind", ["lookup", "claim"])
@pytest.mark.parametrize(
    "keys, why",
    [
        (b"k" * 17, "17 bytes is not a whole number of 16-byte keys"),
        (b"k" * 15, "15 bytes is not a whole number"),
        (b"k" * 33, "1 byte(s) left over"),
        ([b"k" * 16], "Expected `bytes`, got `array`"),  # protocol v1's list of keys
        ("k" * 16, "Expected `bytes`, got `str`"),
        (16, "Expected `bytes`, got `int`"),
        (None, "Expected `bytes`, got `None`"),
        ([[[[b"k" * 16]]]], "Expected `bytes`, got `array`"),
    ],
)
def test_malformed_key_blob_is_a_bad_field_naming_keys(kind, keys, why):
    """Lookup/Claim keys travel as one bin of 16-byte keys; anything else is refused with
    BAD_FIELD naming `$.keys` and what is wrong with it."""
    extra = {"request_id": "r"} if kind == "claim" else {}
    with pytest.raises(ProtocolError) as ei:
        decode(raw(kind=kind, v=V, owner="c", keys=keys, **extra))
    assert ei.value.code == ErrorCode.BAD_FIELD
    assert "$.keys" in ei.value.message and why in ei.value.message
    assert f"bad {kind!r} message" in ei.value.message


def test_keys_travel_packed_in_one_bin():
    msg = Claim(owner="c1", request_id="r", keys=K)
    assert isinstance(msg.keys, KeyBlob) and len(msg.keys) == 3 and msg.keys == K
    assert msg.keys.blob == b"".join(K)
    assert b"".join(K) in encode(msg)  # the keys back to back, no per-key framing
    on_wire = msgspec.msgpack.decode(encode(msg))
    assert on_wire["keys"] == b"".join(K) and on_wire["v"] == V
    back = decode(encode(msg))
    assert isinstance(back.keys, KeyBlob) and back.keys == msg.keys and list(back.keys) == K
    # an empty claim is well formed (the producer answers it with 0 blocks)
    assert decode(raw(kind="claim", v=V, owner="c", request_id="r", keys=b"")).keys == []


def test_a_list_of_keys_is_packed_and_checked_on_construction():
    assert Lookup(owner="c", keys=K) == Lookup(owner="c", keys=KeyBlob(b"".join(K)))
    assert Lookup(owner="c", keys=iter(K)).keys == K
    with pytest.raises(ValueError, match=r"keys\[1\] is 5 bytes"):
        Claim(owner="c", request_id="r", keys=[K[0], b"short"])
    assert Claim(owner="c", request_id="r", keys=b"".join(K)).keys == K  # packed already
    with pytest.raises(ValueError, match="not a whole number"):
        Claim(owner="c", request_id="r", keys=b"".join(K) + b"x")
    with pytest.raises(TypeError):
        Claim(owner="c", request_id="r", keys="k" * 16)


def test_key_blob_limits_and_sequence_behaviour():
    kb = KeyBlob(b"".join(K))
    assert len(kb) == 3 and kb[0] == K[0] and kb[-1] == K[2] and list(kb) == K
    assert kb[1:] == K[1:] and isinstance(kb[1:], KeyBlob) and kb[::2] == K[::2]
    assert kb[5:9] == [] and kb[:0] == KeyBlob()
    assert K[1] in kb and kb.index(K[2]) == 2
    assert kb.array().shape == (3, 2) and kb.array()[1].tobytes() == K[1]
    with pytest.raises(IndexError):
        kb[3]
    with pytest.raises(ValueError, match="not a whole number"):
        KeyBlob(b"x" * (KEY_BYTES + 1))
    from disagg.protocol.version import MAX_KEYS

    with pytest.raises(ValueError, match="more than the limit"):
        KeyBlob(bytes(KEY_BYTES * (MAX_KEYS + 1)))
    too_many = bytes(KEY_BYTES * (MAX_KEYS + 1))
    data = raw(kind="lookup", v=V, owner="c", keys=too_many)
    assert code_of(data, max_bytes=len(data)) == ErrorCode.BAD_FIELD  # the cap, not the frame
    # the frame limit binds first on the wire: the largest Claim that fits is accepted
    n = (MAX_CONTROL_FRAME - 200) // KEY_BYTES
    big = Claim(owner="c", request_id="r", keys=KeyBlob(bytes(KEY_BYTES * n)))
    assert len(decode(encode(big)).keys) == n
    assert code_of(encode(Lookup(owner="c", keys=KeyBlob(bytes(4 << 20))))) == (ErrorCode.TOO_LARGE)


@pytest.mark.parametrize("field", ["v", "kind", "keys", "owner", "unknown_field"])
def test_deeply_nested_frames_are_bad_frames_not_crashes(field):
    """Thousands of nested arrays make msgspec recurse while decoding (or skipping) a
    field; that is a malformed frame, answered like any other, never an exception that
    would end the server thread reading it."""
    body = {"kind": "lookup", "v": V, "owner": "c", "keys": b""}
    body.pop(field, None)
    head = msgspec.msgpack.encode(body)
    assert head[0] >> 4 == 0x8  # a fixmap: one more entry follows, the nested one
    data = (
        bytes([head[0] + 1]) + head[1:] + msgspec.msgpack.encode(field) + b"\x91" * 5000 + b"\x01"
    )
    code = code_of(data)
    assert code in (ErrorCode.BAD_FRAME, ErrorCode.BAD_FIELD, ErrorCode.BAD_VERSION)


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


@pytest.mark.parametrize("kind", [{"a": 1}, [1], 7])
def test_a_kind_that_is_not_a_string_is_a_bad_frame(kind: object) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(msgspec.msgpack.encode({"kind": kind, "v": PROTOCOL_VERSION}))
    assert e.value.code is ErrorCode.BAD_FRAME and "kind" in e.value.message
