"""Authentication: CURVE on the control and event sockets, and the data plane bound to
leases granted over the authenticated channel.

Guarantees proved here:
- a peer without a key, with a wrong server key, or with a key that is not allowed is
  refused within its deadline and learns nothing but that (``HandshakeRefused`` with its
  reason, from its own socket monitor): no reply byte, no event;
- a peer with the key works end to end (tokens equal to the monolithic run);
- an authenticated peer cannot act as another consumer (owner name bound to its key);
- ``cache_salt`` isolation holds for authenticated peers;
- a stranger who knows the consumer's data endpoint cannot write a byte into its pools,
  and there is no way to read a page except Push over the authenticated control channel.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter

import pytest
import torch
import zmq
from security_harness import (
    SHAPE,
    KeyPair,
    close_all_services,
    free_port,
    make_consumer,
    make_producer,
    prompts,
    run,
    wait_for,
)

from disagg.consumer import refusals as consumer_refusals
from disagg.engine.reference import Engine, EngineConfig
from disagg.protocol import messages as m
from disagg.protocol.errors import ErrorCode, ProtocolError
from disagg.transport import ControlClient, ControlServer, EventPublisher, EventSubscriber
from disagg.transport.refusals import HandshakeRefused, RefusalLog
from disagg.transport.tcp import StreamPush, TcpDataPlane

DEADLINE = 0.5


@pytest.fixture(autouse=True)
def _close_services():
    yield
    close_all_services()


@pytest.fixture
def keys(tmp_path):
    return {name: KeyPair(tmp_path, name) for name in ("server", "client", "other", "stranger")}


def _echo(ident, msg):
    return m.LookupOk(num_blocks=7)


# --------------------------------------------------------------------- control socket


def _refused(endpoint: str, reason: str, **kw) -> float:
    """Call with ``kw``; it must be refused at the handshake for ``reason`` (told by the
    client's own socket monitor: no reply). Returns the time the refusal took."""
    t0 = time.monotonic()
    with ControlClient(endpoint, **kw) as c, pytest.raises(HandshakeRefused) as ei:
        c.call(m.Heartbeat(owner="x"), timeout_s=DEADLINE)
    assert ei.value.code is ErrorCode.UNAUTHENTICATED and ei.value.reason == reason, ei.value
    return time.monotonic() - t0


def test_control_refuses_strangers_within_the_deadline_and_serves_the_key_holder(keys):
    s, c, o = keys["server"], keys["client"], keys["other"]
    calls = []

    def handler(ident, msg):
        calls.append(srv.peer_key)
        return m.LookupOk(num_blocks=7)

    srv = ControlServer("tcp://127.0.0.1:0", handler, curve=(s.secret, s.public, [c.public]))
    with srv:
        for reason, kw in (
            ("curve_mismatch", {}),  # no key at all (NULL mechanism)
            ("server_key_mismatch", {"curve": (c.secret, c.public, o.public)}),  # wrong server
            ("key_not_allowed", {"curve": (o.secret, o.public, s.public)}),  # not on the list
            # claims c's public key, lacks its secret: the server cannot open its handshake
            ("server_key_mismatch", {"curve": (o.secret, c.public, s.public)}),
        ):
            assert _refused(srv.endpoint, reason, **kw) < DEADLINE + 0.3, kw
        assert calls == []  # the handler never saw a stranger's request
        with ControlClient(srv.endpoint, curve=(c.secret, c.public, s.public)) as good:
            assert good.call(m.Heartbeat(owner="x")) == m.LookupOk(num_blocks=7)
        assert calls == [c.public]  # the handler learns who is calling
        assert wait_for(lambda: srv.stats["auth_refused"] >= 1)
        assert wait_for(lambda: srv.stats["handshake_failed"] >= 3)


def test_a_stranger_learns_nothing_not_even_an_error(keys):
    """A raw socket without the key sends well-formed and garbage requests: no byte back."""
    s = keys["server"]
    with ControlServer("tcp://127.0.0.1:0", _echo, curve=(s.secret, s.public, None)) as srv:
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(srv.endpoint)
        try:
            for body in (m.encode(m.Heartbeat(owner="x")), b"\xc1garbage", b""):
                d.send_multipart([b"corr0001", body])
            assert d.poll(int(DEADLINE * 1000)) == 0
        finally:
            d.close()
        assert srv.stats["ok"] == 0 and srv.stats["handshake_failed"] >= 1


def test_allow_any_accepts_any_key_holder_of_the_server_key(keys):
    s, o = keys["server"], keys["other"]
    with ControlServer("tcp://127.0.0.1:0", _echo, curve=(s.secret, s.public, None)) as srv:
        with ControlClient(srv.endpoint, curve=(o.secret, o.public, s.public)) as c:
            assert c.call(m.Heartbeat(owner="x")).num_blocks == 7
        _refused(srv.endpoint, "curve_mismatch")  # still no entry without CURVE


# --------------------------------------------------------------------- event socket


def test_events_reach_only_subscribers_with_the_key(keys):
    s, c, o = keys["server"], keys["client"], keys["other"]
    pub = EventPublisher("tcp://127.0.0.1:0", producer="p", curve=(s.secret, s.public, [c.public]))
    got: dict[str, list] = {"good": [], "nokey": [], "wrongsrv": [], "unlisted": []}
    snaps: dict[str, int] = {k: 0 for k in got}

    def sub(name, curve):
        def snapshot(producer):
            snaps[name] += 1
            return m.SnapshotOk(producer=producer, seq=pub.seq, keys=[])

        return EventSubscriber([pub.endpoint], got[name].append, snapshot, curve=curve)

    subs = [
        sub("good", (c.secret, c.public, s.public)),
        sub("nokey", None),
        sub("wrongsrv", (c.secret, c.public, o.public)),
        sub("unlisted", (o.secret, o.public, s.public)),
    ]
    try:
        key = secrets.token_bytes(16)
        assert wait_for(lambda: (pub.publish_stored([key]), len(got["good"]) > 0)[1])
        for name in ("nokey", "wrongsrv", "unlisted"):
            assert got[name] == [] and snaps[name] == 0, name
            assert subs[[*got].index(name)].stats["events"] == 0
        assert wait_for(lambda: pub.stats["auth_refused"] >= 1)
    finally:
        for sb in subs:
            sb.close()
        pub.close()


# --------------------------------------------------------------------- end to end


def _secured_pair(keys, cfg, *, producer_allows=None, consumer=None, **csection):
    s, c = keys["server"], keys["client"]
    allowed = [str(c.public_file)] if producer_allows is None else producer_allows
    prod, psvc = make_producer(cfg, security=s.section(allowed_client_keys=allowed))
    csec = consumer if consumer is not None else c.section(server_public_key=str(s.public_file))
    cons, csvc = make_consumer(cfg, [psvc.endpoint], security=csec or None, **csection)
    return prod, psvc, cons, csvc


def test_key_holder_works_end_to_end_and_strangers_get_misses(keys):
    cfg = EngineConfig(**SHAPE, capture_pages=True)
    ps = prompts()
    mono = Engine(cfg).generate(ps, max_tokens=5)
    prod, psvc, cons, csvc = _secured_pair(keys, cfg)
    produced = run(prod, ps, 1)
    consumed = run(cons, ps, 5)
    assert [r.error for r in consumed] == [None] * len(ps)
    assert [r.tokens for r in consumed] == mono
    assert all(r.connector_matched_tokens > 0 for r in consumed)
    for p, c in zip(produced, consumed, strict=True):
        for where, data in c.loaded_pages.items():
            assert data == p.computed_pages[where]
    assert psvc.server.stats["auth_ok"] >= 1

    # Strangers: no security section; a key the producer does not allow; a consumer that
    # trusts the wrong server key. Each is a miss (the engine recomputes, right tokens).
    s, o = keys["server"], keys["other"]
    for sec in (
        None,
        o.section(server_public_key=str(s.public_file)),
        o.section(server_public_key=str(keys["stranger"].public_file)),
    ):
        stranger, ssvc = make_consumer(cfg, [psvc.endpoint], security=sec)
        t0 = time.monotonic()
        results = run(stranger, ps[:1], 5)
        assert time.monotonic() - t0 < 10
        assert results[0].tokens == mono[0] and results[0].connector_matched_tokens == 0
        assert ssvc.metrics["claims_hit"] == 0
    assert psvc.metrics["claims_hit"] == len(ps)  # only the key holder ever claimed
    assert wait_for(lambda: psvc.server.stats["auth_refused"] >= 1)
    assert wait_for(lambda: psvc.leases.active() == 0)


def test_a_refusing_producer_is_skipped_then_used_once_it_accepts_us(keys, monkeypatch, caplog):
    """A producer that refuses our key is said once and skipped without a call; once the
    operator lists the key (a producer restarted on the same endpoint), the background
    retry finds it accepting us and requests load from it again."""
    monkeypatch.setattr(consumer_refusals, "REFUSED_RETRY_S", 0.2)
    cfg = EngineConfig(**SHAPE)
    ps = prompts(n=1)
    mono = Engine(cfg).generate(ps, max_tokens=4)
    s, c, o = keys["server"], keys["client"], keys["other"]
    control = f"tcp://127.0.0.1:{free_port()}"
    _, old = make_producer(
        cfg, security=s.section(allowed_client_keys=[str(o.public_file)]), control=control
    )
    cons, csvc = make_consumer(
        cfg, [control], security=c.section(server_public_key=str(s.public_file))
    )
    (link,) = csvc.links
    with caplog.at_level("WARNING", logger="disagg.consumer"):
        for salt in ("a", "b"):  # salted: not in this engine's device cache either
            (res,) = run(cons, ps, 4, salt=salt)
            assert res.tokens == mono[0] and res.connector_matched_tokens == 0
        assert link.refusal is not None and link.refusal.reason == "key_not_allowed"
        assert csvc.metrics["claims_no_producer"] == 1  # the second request made no call
        assert csvc.refusals.report()["degraded"].startswith("every producer refuses")
        old.close()
        prod, _ = make_producer(
            cfg, security=s.section(allowed_client_keys=[str(c.public_file)]), control=control
        )
        run(prod, ps, 1, salt="c")
        assert wait_for(lambda: link.refusal is None, 5)
        (res,) = run(cons, ps, 4, salt="c")
    assert res.tokens == mono[0] and res.connector_matched_tokens > 0
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sum("refuses this consumer (key_not_allowed)" in w for w in said) == 1, said
    assert sum("accepts this consumer again" in w for w in said) == 1, said
    assert csvc.refusals.report() == {"refused_by": []}


def test_refusals_are_counted_each_and_said_once_per_peer_and_interval(caplog):
    counts: Counter[str] = Counter()
    log_ = RefusalLog("test server", counts, every_s=60)
    with caplog.at_level("WARNING", logger="disagg.security"):
        for _ in range(3):
            log_.refused("key_not_allowed", "not listed", address="10.0.0.1", key=b"k" * 40)
        log_.refused("key_not_allowed", "not listed", address="10.0.0.2", key=b"j" * 40)
        log_.refused("curve_mismatch", "no CURVE")
    assert counts == {"refused_key_not_allowed": 4, "refused_curve_mismatch": 1}
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3, said
    assert "refused peer 10.0.0.1 with CURVE key " + "k" * 40 in said[0]
    assert "ZMQ names neither address nor key" in said[2]


def test_cache_salt_isolation_holds_for_authenticated_peers(keys):
    cfg = EngineConfig(**SHAPE)
    ps = prompts(n=1)
    prod, psvc, cons, _ = _secured_pair(keys, cfg)
    run(prod, ps, 1, salt="tenant-a")
    (other,) = run(cons, ps, 4, salt="tenant-b")
    assert other.connector_matched_tokens == 0
    (none,) = run(cons, [ps[0][:-1] + [3]], 4)  # no salt is another namespace too
    assert none.connector_matched_tokens == 0
    (same,) = run(cons, [ps[0][:-1] + [7]], 4, salt="tenant-a")
    assert same.connector_matched_tokens > 0


def test_an_authenticated_peer_cannot_act_as_another_consumer(keys):
    """Owner names are bound to the CURVE key that first said Hello with them."""
    cfg = EngineConfig(**SHAPE)
    ps = prompts(n=1)
    s, c, o = keys["server"], keys["client"], keys["other"]
    prod, psvc = make_producer(
        cfg, security=s.section(allowed_client_keys=[c.public.decode(), o.public.decode()])
    )
    run(prod, ps, 1)
    fp = psvc.fingerprint
    victim = ControlClient(psvc.endpoint, curve=(c.secret, c.public, s.public))
    thief = ControlClient(psvc.endpoint, curve=(o.secret, o.public, s.public))
    try:
        victim.call(m.Hello(instance_id="victim", role="consumer", fingerprint=fp))
        keys_ = list(psvc.store.keys())
        lease = victim.call(m.Claim(owner="victim", request_id="1", keys=keys_[:1]))
        assert lease.lease_id > 0
        with pytest.raises(ProtocolError) as ei:
            thief.call(m.Hello(instance_id="victim", role="consumer", fingerprint=fp))
        assert ei.value.code is ErrorCode.UNAUTHENTICATED and "victim" in ei.value.message
        thief.call(m.Hello(instance_id="thief", role="consumer", fingerprint=fp))
        with pytest.raises(ProtocolError) as ei:
            thief.call(m.Release(owner="victim", lease_id=lease.lease_id))
        assert ei.value.code is ErrorCode.UNAUTHENTICATED
        with pytest.raises(ProtocolError) as ei:
            thief.call(m.Release(owner="thief", lease_id=lease.lease_id))
        assert ei.value.code is ErrorCode.FOREIGN_LEASE
        assert psvc.leases.active() == 1
        victim.call(m.Release(owner="victim", lease_id=lease.lease_id))
        assert psvc.leases.active() == 0
    finally:
        victim.close()
        thief.close()


# --------------------------------------------------------------------- data plane


@pytest.fixture
def receiver():
    plane = TcpDataPlane("tcp://127.0.0.1:0")
    yield plane
    plane.close()


def test_stranger_cannot_write_into_the_consumer_pools(receiver):
    """Knowing the data endpoint is not enough: every batch must name a transfer the
    consumer expects, with its lease id and its 16 random token bytes (which travelled
    only inside the authenticated Push)."""
    pb, slots = 64, 32
    backing = torch.randint(0, 256, (slots + 2, pb), dtype=torch.uint8)
    receiver.register_regions([[backing[1:-1]]])  # guard rows on both sides
    before = backing.clone()
    tid, lease, token = 41, 9, secrets.token_bytes(16)
    receiver.expect(tid, lease, token, [4], deadline_s=10)

    s = StreamPush(receiver.endpoint)  # the data plane's own wire
    payload = b"\xff" * (4 * pb)

    def batch(**kw):
        h = dict(transfer_id=tid, lease_id=lease, token=token, group=0, runs=[(0, 4)])
        h.update(kw)
        s.send_multipart([m.encode(m.PageBatch(page_bytes=pb, **h)), payload])

    attempts = [
        dict(token=b""),  # no token
        dict(token=secrets.token_bytes(16)),  # a wrong token
        dict(token=token[:-1] + bytes([token[-1] ^ 1])),  # one bit off
        dict(transfer_id=tid + 1),  # a guessed transfer id (with the right token)
        dict(transfer_id=0, token=b""),
        dict(lease_id=lease + 1),  # the right transfer and token, a foreign lease
    ]
    for kw in attempts:
        batch(**kw)
    s.send(m.encode(m.TransferDone(transfer_id=tid, lease_id=lease, token=b"guess")))
    n = len(attempts) + 1
    assert wait_for(lambda: sum(v for k, v in receiver.stats.items() if "rejected" in k) >= n)
    s.close()
    assert torch.equal(backing, before)  # not one byte written anywhere
    assert receiver.poll(tid).state.value == "pending"  # and the real transfer is unharmed
    assert receiver.stats["rejected_unknown"] == n


def test_no_page_can_be_read_without_the_authenticated_channel(keys):
    """The data plane has no read request: its socket only receives (a PULL), so asking it
    for pages gets nothing back. The only way pages leave a producer is a Push on the
    control channel, which needs CURVE, a Hello and a lease the caller owns."""
    cfg = EngineConfig(**SHAPE)
    ps = prompts(n=1)
    s, c = keys["server"], keys["client"]
    prod, psvc = make_producer(cfg, security=s.section(allowed_client_keys=[c.public.decode()]))
    run(prod, ps, 1)
    push = m.Push(
        owner="x",
        lease_id=1,
        transfer_id=1,
        data_endpoint="tcp://127.0.0.1:9",
        first_block=0,
        num_blocks=0,
        dst_slots=[[] for _ in psvc.pool.groups],
    )
    _refused(psvc.endpoint, "curve_mismatch")  # without CURVE: no connection at all
    with ControlClient(psvc.endpoint, curve=(c.secret, c.public, s.public)) as cl:
        with pytest.raises(ProtocolError) as ei:  # authenticated, but no Hello yet
            cl.call(push)
        assert ei.value.code is ErrorCode.UNAUTHENTICATED
        cl.call(m.Hello(instance_id="x", role="consumer", fingerprint=psvc.fingerprint))
        with pytest.raises(ProtocolError) as ei:  # a lease it does not hold
            cl.call(push)
        assert ei.value.code is ErrorCode.UNKNOWN_LEASE
    assert psvc.metrics["pushes_done"] == 0 and psvc.metrics.get("pages_pushed", 0) == 0

    plane = TcpDataPlane("tcp://127.0.0.1:0")
    try:
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(plane.endpoint)
        d.send(m.encode(push))
        assert d.poll(300) == 0  # a PULL socket never answers
        d.close()
    finally:
        plane.close()
