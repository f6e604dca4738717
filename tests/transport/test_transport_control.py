import threading
import time

import pytest
import zmq

from disagg.protocol import (
    ErrorCode,
    Heartbeat,
    Lookup,
    LookupOk,
    Ok,
    ProtocolError,
    Release,
    decode,
    encode,
)
from disagg.transport import ControlClient, ControlServer


def handler(ident, msg):
    if isinstance(msg, Lookup):
        return LookupOk(num_blocks=len(msg.keys))
    if isinstance(msg, Release):
        raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"lease {msg.lease_id} is unknown")
    if isinstance(msg, Heartbeat) and msg.owner == "boom":
        raise RuntimeError("handler bug")
    if isinstance(msg, Heartbeat) and msg.owner == "slow":
        time.sleep(0.5)
    return None


@pytest.fixture
def server():
    with ControlServer("tcp://127.0.0.1:0", handler) as srv:
        yield srv


def test_call_and_typed_errors(server):
    assert server.endpoint.startswith("tcp://127.0.0.1:") and not server.endpoint.endswith(":0")
    with ControlClient(server.endpoint) as c:
        assert c.call(Lookup(owner="c", keys=[b"k" * 16] * 3)) == LookupOk(num_blocks=3)
        assert c.call(Heartbeat(owner="c")) == Ok()
        with pytest.raises(ProtocolError) as ei:
            c.call(Release(owner="c", lease_id=4))
        assert ei.value.code == ErrorCode.UNKNOWN_LEASE and "lease 4" in ei.value.message
        with pytest.raises(ProtocolError) as ei:
            c.call(Heartbeat(owner="boom"))
        assert ei.value.code == ErrorCode.INTERNAL
        assert c.call(Heartbeat(owner="c")) == Ok()  # server still serving
    assert server.stats["UNKNOWN_LEASE"] == 1 and server.stats["INTERNAL"] == 1


def test_server_survives_garbage(server):
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(server.endpoint)
    try:
        cases = [
            ([b"c1", b"\xc1garbage"], ErrorCode.BAD_FRAME),
            ([b"c2", b""], ErrorCode.BAD_FRAME),
            ([b"c3", encode(Ok())[:-1] + b"\x00\x00"], None),  # some decode error
            ([b"only-one-frame"], ErrorCode.BAD_FRAME),
            ([b"c5", b"x", b"y"], ErrorCode.BAD_FRAME),
            ([b"c6", b"\x81\xa4kind\xa3zzz"], ErrorCode.UNKNOWN_KIND),
        ]
        for frames, code in cases:
            d.send_multipart(frames)
            assert d.poll(2000), frames
            reply = d.recv_multipart()
            err = decode(reply[-1])
            assert err.code != 0
            if code is not None:
                assert err.code == code, (frames, err)
        d.send(b"")  # a single empty frame: nothing to answer, must not kill the server
    finally:
        d.close()
    with ControlClient(server.endpoint) as c:
        assert c.call(Heartbeat(owner="c")) == Ok()
    assert server.stats["BAD_FRAME"] >= 4


def test_timeout_on_dead_server():
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.ROUTER)  # bound but never answers
    s.bind("tcp://127.0.0.1:0")
    ep = s.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        with ControlClient(ep, default_timeout_s=0.3) as c:
            t = time.monotonic()
            with pytest.raises(ProtocolError) as ei:
                c.call(Heartbeat(owner="c"))
            assert ei.value.code == ErrorCode.TIMEOUT
            assert time.monotonic() - t < 1.0
    finally:
        s.close(linger=0)
    with ControlClient("tcp://127.0.0.1:1", default_timeout_s=0.2) as c:  # nobody there
        with pytest.raises(ProtocolError) as ei:
            c.call(Heartbeat(owner="c"))
        assert ei.value.code == ErrorCode.TIMEOUT


@pytest.mark.parametrize("peer", ["silent", "absent"])
def test_close_ends_a_call_under_way(peer):
    """``close`` from another thread ends a call waiting on a silent peer's reply, or on
    a connection to an absent one, at once (PEER_GONE), not at the call's timeout; no
    call is made after it."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.ROUTER)  # bound but never answers
    s.bind("tcp://127.0.0.1:0")
    ep = s.getsockopt_string(zmq.LAST_ENDPOINT) if peer == "silent" else "tcp://127.0.0.1:1"
    c = ControlClient(ep)
    got: list[BaseException] = []

    def call() -> None:
        try:
            c.call(Heartbeat(owner="c"), timeout_s=30.0)
        except ProtocolError as e:
            got.append(e)

    t = threading.Thread(target=call)
    try:
        t.start()
        time.sleep(0.3)  # the call is waiting
        assert t.is_alive() and not got
        c.close()
        t.join(10.0)
        assert not t.is_alive(), "the call outlived close()"
        assert got and got[0].code == ErrorCode.PEER_GONE, got
        with pytest.raises(ProtocolError) as ei:
            c.call(Heartbeat(owner="c"))
        assert ei.value.code == ErrorCode.PEER_GONE
    finally:
        c.close()
        s.close(linger=0)


def test_late_reply_not_matched_to_next_call(server):
    with ControlClient(server.endpoint) as c:
        with pytest.raises(ProtocolError) as ei:
            c.call(Heartbeat(owner="slow"), timeout_s=0.1)
        assert ei.value.code == ErrorCode.TIMEOUT
        reply = c.call(Lookup(owner="c", keys=[b"k" * 16]), timeout_s=2.0)
        assert reply == LookupOk(num_blocks=1)


def test_threaded_callers(server):
    errors = []
    with ControlClient(server.endpoint) as c:

        def work(n):
            try:
                for i in range(30):
                    r = c.call(Lookup(owner="c", keys=[b"k" * 16] * ((n + i) % 5)))
                    assert r.num_blocks == (n + i) % 5
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors


def test_curve_keys_are_checked_and_a_key_holder_is_served():
    """CURVE itself is tested in tests/security/test_curve.py."""
    with pytest.raises(ValueError, match="Z85"):
        ControlServer("tcp://127.0.0.1:0", handler, curve=(b"x" * 40, b"short", None))
    pub, sec = zmq.curve_keypair()
    cpub, csec = zmq.curve_keypair()
    with ControlServer("tcp://127.0.0.1:0", handler, curve=(sec, pub, [cpub])) as srv:
        with ControlClient(srv.endpoint, curve=(csec, cpub, pub)) as c:
            assert c.call(Heartbeat(owner="c")) == Ok()


class _SlowLink:
    """A TCP forwarder that delivers every byte ``delay_s`` after it was read, both ways:
    a peer whose handshake takes longer than one call's timeout (a resumed or starved
    process, a long path)."""

    def __init__(self, target: str, delay_s: float):
        import socket

        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target, self.delay_s = (host, int(port)), delay_s
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.lsock.getsockname()[1]}"
        self.accepted = 0
        self._socks: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                a, _ = self.lsock.accept()
            except OSError:
                return
            self.accepted += 1
            b = socket.create_connection(self.target)
            self._socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src, dst) -> None:
        import queue

        q: queue.Queue = queue.Queue()

        def deliver() -> None:
            while (item := q.get()) is not None:
                at, data = item
                time.sleep(max(0.0, at - time.monotonic()))
                try:
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=deliver, daemon=True).start()
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                q.put(None)
                return
            q.put((time.monotonic() + self.delay_s, data))

    def close(self) -> None:
        self.lsock.close()
        for s in self._socks:
            s.close()


def test_a_handshake_slower_than_one_call_completes_for_a_later_call(server):
    """A call that found no connection queued nothing, so its timeout keeps the socket and
    the handshake under way: the next call goes out on it. Recreating the socket on every
    such timeout would restart the handshake each time, and never reach a peer whose
    handshake takes longer than one call's timeout (a process resumed after a stop, or
    starved)."""
    link = _SlowLink(server.endpoint, delay_s=0.25)  # a handshake of several round trips
    try:
        with ControlClient(link.endpoint, default_timeout_s=0.2) as c:
            with pytest.raises(ProtocolError) as ei:
                c.call(Heartbeat(owner="c"))
            assert ei.value.code == ErrorCode.TIMEOUT and "not connected" in ei.value.message
            time.sleep(2.5)  # the handshake completes meanwhile, on the kept socket
            assert c.call(Heartbeat(owner="c"), timeout_s=1.0) == Ok()
            assert link.accepted == 1  # one connection, kept across the timeout
    finally:
        link.close()


def test_a_handler_answers_later_from_call_soon_while_others_are_served():
    """A handler may hold its answer (``later()``): other callers are served meanwhile,
    and the answer goes out when a function given to ``call_soon`` from another thread
    runs it on the server thread."""
    held = []

    def parking(ident, msg):
        if isinstance(msg, Lookup) and msg.owner == "wait":
            held.append(srv.later())
            return held[-1]
        return handler(ident, msg)

    srv = ControlServer("tcp://127.0.0.1:0", parking)
    with srv, ControlClient(srv.endpoint) as waiting, ControlClient(srv.endpoint) as other:
        out = []
        t = threading.Thread(
            target=lambda: out.append(waiting.call(Lookup(owner="wait", keys=[]), timeout_s=5))
        )
        t.start()
        deadline = time.monotonic() + 5
        while not held:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert other.call(Heartbeat(owner="c")) == Ok()  # served while the first waits
        assert not out
        srv.call_soon(lambda: held[0].answer(LookupOk(num_blocks=7)))  # from this thread
        t.join(5)
        assert out == [LookupOk(num_blocks=7)]
        srv.call_soon(lambda: held[0].answer(LookupOk(num_blocks=8)))  # answered once only
        assert other.call(Lookup(owner="c", keys=[b"k" * 16])) == LookupOk(num_blocks=1)
