import time

from disagg.protocol import Removed, SnapshotOk, Stored
from disagg.transport import EventPublisher, EventSubscriber

K = [bytes([i]) * 16 for i in range(10)]


def wait_for(cond, timeout=3.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


class Index:
    """What a consumer would keep: keys per producer."""

    def __init__(self):
        self.keys = {}
        self.log = []

    def on_event(self, ev):
        self.log.append(ev)
        if isinstance(ev, SnapshotOk):
            self.keys[ev.producer] = set(ev.keys)
        elif isinstance(ev, Stored):
            self.keys.setdefault(ev.producer, set()).update(ev.keys)
        elif isinstance(ev, Removed):
            self.keys.setdefault(ev.producer, set()).difference_update(ev.keys)


def test_events_in_order_and_gap_resync():
    pub = EventPublisher("tcp://127.0.0.1:0", "p1")
    held = set()

    def snapshot(producer):
        assert producer == "p1"
        return SnapshotOk(producer="p1", seq=pub.seq, keys=sorted(held))

    idx = Index()
    sub = EventSubscriber([pub.endpoint], idx.on_event, snapshot)
    try:
        # slow joiner: keep publishing until the subscriber sees something
        assert wait_for(lambda: (held.add(K[0]), pub.publish_stored([K[0]]), bool(idx.log))[-1])
        assert isinstance(idx.log[0], SnapshotOk)  # first contact = resync
        held.update(K[1:3])
        pub.publish_stored(K[1:3])
        held.discard(K[0])
        pub.publish_removed([K[0]])
        assert wait_for(lambda: idx.keys.get("p1") == held)
        resyncs = sub.stats["resyncs"]
        # simulate lost events: bump seq without sending
        held.add(K[5])
        pub.seq += 3
        held.add(K[6])
        pub.publish_stored([K[6]])
        assert wait_for(lambda: sub.stats["resyncs"] == resyncs + 1)
        assert wait_for(lambda: idx.keys.get("p1") == held)  # K[5] came via the snapshot
    finally:
        sub.close()
        pub.close()


def test_failed_snapshot_retries():
    pub = EventPublisher("tcp://127.0.0.1:0", "p2")
    calls = []

    def snapshot(producer):
        calls.append(producer)
        if len(calls) == 1:
            from disagg.protocol import ErrorCode, ProtocolError

            raise ProtocolError(ErrorCode.TIMEOUT, "down")
        return SnapshotOk(producer=producer, seq=pub.seq, keys=[])

    idx = Index()
    sub = EventSubscriber([pub.endpoint], idx.on_event, snapshot)
    try:
        assert wait_for(lambda: (pub.publish_stored([K[1]]), len(calls) >= 2)[-1])
        assert wait_for(lambda: "p2" in idx.keys)
    finally:
        sub.close()
        pub.close()
