"""Claim/Lookup on the wire (protocol v2: keys packed in one bin): a producer answers a
malformed key blob with a typed BAD_FIELD naming the field, an old peer with BAD_VERSION,
and keeps serving valid claims afterwards."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from harness import SHAPE, close_all_services, make_producer, prompts, run

from disagg.engine.reference import EngineConfig
from disagg.protocol import messages as m
from disagg.protocol.errors import ErrorCode
from disagg.protocol.keys import KeyBlob, block_key_blob
from disagg.protocol.version import PROTOCOL_VERSION
from disagg.transport import ControlClient

CFG = EngineConfig(**SHAPE)


@pytest.fixture(scope="module")
def producer():
    prod, psvc = make_producer(CFG)
    ps = prompts(n=1)
    run(prod, ps, 1)
    tpb = CFG.tokens_per_block
    keys = block_key_blob(psvc.namespace_seed(None), ps[0], tpb)
    assert psvc.store.longest_prefix(keys) == len(keys) > 2
    yield psvc, keys
    close_all_services()


def _send(d: zmq.Socket, body: bytes) -> m.Message:
    d.send_multipart([b"corr-id!", body])
    assert d.poll(5000), "the producer did not answer"
    return m.decode(d.recv_multipart()[-1])


def _raw(kind: str, **fields) -> bytes:
    return msgspec.msgpack.encode({"kind": kind, "v": PROTOCOL_VERSION, **fields})


@pytest.mark.parametrize("kind", ["claim", "lookup"])
def test_malformed_key_blobs_get_bad_field_and_the_producer_keeps_serving(producer, kind):
    psvc, keys = producer
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(psvc.endpoint)
    try:
        hello = m.Hello(instance_id="wire", role="consumer", fingerprint=psvc.fingerprint)
        assert isinstance(_send(d, m.encode(hello)), m.HelloOk)
        extra = {"request_id": "r"} if kind == "claim" else {}
        for bad, why in [
            (keys.blob[:-1], "not a whole number of 16-byte keys"),
            (keys.blob + b"x" * 3, "3 byte(s) left over"),
            (keys.tolist(), "Expected `bytes`, got `array`"),  # protocol v1's shape
            ("k" * 32, "Expected `bytes`, got `str`"),
        ]:
            reply = _send(d, _raw(kind, owner="wire", keys=bad, **extra))
            assert isinstance(reply, m.Error), reply
            assert ErrorCode.from_wire(reply.code) is ErrorCode.BAD_FIELD
            assert "$.keys" in reply.message and why in reply.message
        # a v1 peer is told to upgrade, not handed a field error
        old = msgspec.msgpack.encode({"kind": kind, "v": 1, "owner": "wire", "keys": [keys[0]]})
        reply = _send(d, old)
        assert isinstance(reply, m.Error)
        assert ErrorCode.from_wire(reply.code) is ErrorCode.BAD_VERSION
        assert "upgrade the older peer" in reply.message
        # nothing was pinned by the refused frames; the same connection still claims
        assert psvc.store.pinned_blocks() == 0
        ok = _send(d, _raw(kind, owner="wire", keys=keys.blob, **extra))
        assert ok.num_blocks == len(keys)
        if kind == "claim":
            assert isinstance(ok, m.ClaimOk) and ok.lease_id > 0
            assert psvc.store.pinned_blocks() == len(keys)
            assert isinstance(
                _send(d, m.encode(m.Release(owner="wire", lease_id=ok.lease_id))), m.Ok
            )
    finally:
        d.close()
    assert psvc.server.alive() and psvc.store.pinned_blocks() == 0
    assert psvc.server.stats["BAD_FIELD"] >= 4 and psvc.server.stats["INTERNAL"] == 0


def test_a_deeply_nested_frame_is_answered_and_the_server_lives(producer):
    """One small frame with thousands of nested arrays in ``v`` (or any field) used to
    raise RecursionError out of decode() and end the control thread: now BAD_FRAME."""
    psvc, keys = producer
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(psvc.endpoint)
    try:
        for field in (b"\xa1v", b"\xa4keys", b"\xa5extra"):
            head = msgspec.msgpack.encode({"kind": "lookup", "owner": "x"})
            body = bytes([head[0] + 1]) + head[1:] + field + b"\x91" * 5000 + b"\x01"
            reply = _send(d, body)
            assert isinstance(reply, m.Error), reply
            code = ErrorCode.from_wire(reply.code)
            assert code in (ErrorCode.BAD_FRAME, ErrorCode.BAD_FIELD), reply
    finally:
        d.close()
    assert psvc.server.alive()
    with ControlClient(psvc.endpoint) as c:
        c.call(m.Hello(instance_id="after", role="consumer", fingerprint=psvc.fingerprint))
        assert c.call(m.Lookup(owner="after", keys=keys)).num_blocks == len(keys)


def test_claims_of_packed_keys_lease_exactly_the_held_prefix(producer):
    psvc, keys = producer
    unknown = KeyBlob(b"\x07" * 16 * 3)
    with ControlClient(psvc.endpoint) as c:
        c.call(m.Hello(instance_id="wire2", role="consumer", fingerprint=psvc.fingerprint))
        assert c.call(m.Lookup(owner="wire2", keys=keys)).num_blocks == len(keys)
        assert c.call(m.Lookup(owner="wire2", keys=keys[1:])).num_blocks == len(keys) - 1
        gap = KeyBlob(unknown.blob + keys.blob)  # held keys after one that is not: none
        assert c.call(m.Lookup(owner="wire2", keys=gap)).num_blocks == 0
        ok = c.call(m.Claim(owner="wire2", request_id="1", keys=KeyBlob(keys.blob + unknown.blob)))
        assert ok.num_blocks == len(keys)
        lease = psvc.leases.get("wire2", ok.lease_id)
        assert isinstance(lease.keys, KeyBlob) and lease.keys == keys
        assert c.call(m.Claim(owner="wire2", request_id="2", keys=unknown)).num_blocks == 0
        assert c.call(m.Claim(owner="wire2", request_id="3", keys=KeyBlob())).num_blocks == 0
        c.call(m.Release(owner="wire2", lease_id=ok.lease_id))
    assert psvc.store.pinned_blocks() == 0
