"""Spin-then-block waits (``spin.py`` over ``_spin.c``) and the ipc plane with them on:
a spin sees what arrives within its window, gives up after it, holds no GIL meanwhile;
a plane whose threads spin still lands every page exactly, wakes its waiters when an
answer comes after the window, and burns no CPU once idle."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from disagg.config import ConfigError, DisaggConfig
from disagg.transport import spin
from disagg.transport.dataplane import StoreRows, TransferState
from disagg.transport.factory import make_data_plane
from disagg.transport.ipc import IpcDataPlane

pytestmark = pytest.mark.timeout(60)
pytest.importorskip("disagg.transport._spin")
DEVICE = os.environ.get("DISAGG_TEST_DEVICE", "cpu")
MS = 1_000_000  # ns


def test_wait_readable_sees_data_at_once_and_gives_up_after_its_window():
    r, w = os.pipe()
    try:
        t0 = time.monotonic()
        assert not spin.wait_readable(r, 30 * MS)
        assert time.monotonic() - t0 >= 0.025, "gave up before its window"
        threading.Timer(0.01, os.write, (w, b"x")).start()
        t0 = time.monotonic()
        assert spin.wait_readable(r, 2000 * MS)
        assert time.monotonic() - t0 < 1.0, "did not see the byte written during the spin"
        assert not spin.wait_readable(r, 0), "a zero window must not spin (nor poll)"
    finally:
        os.close(r)
        os.close(w)


def test_wait_readable_publishes_flags_with_the_gil_released():
    """The flags are set before the spin (a waiter sees them while this thread spins),
    also with a zero window; bad flags are refused before anything is set."""
    r, w = os.pipe()
    try:
        flags = [bytearray(1), bytearray(2)]
        seen = []

        def waiter() -> None:
            seen.append(spin.wait_flag(flags[1], 2000 * MS))

        t = threading.Thread(target=waiter)
        t.start()
        assert not spin.wait_readable(r, 300 * MS, flags)
        t.join()
        assert flags == [bytearray(b"\x01"), bytearray(b"\x01\x00")] and seen == [True]
        zero = [bytearray(1)]
        assert not spin.wait_readable(r, 0, zero) and zero[0][0] == 1
        for bad, why in (([bytearray(0)], "empty"), ([b"\x00"], "writable"), (5, "sequence")):
            ok = bytearray(1)
            with pytest.raises((ValueError, TypeError, BufferError), match=why):
                spin._spin.wait_readable(r, MS, [ok, *bad] if isinstance(bad, list) else bad)
            assert ok[0] == 0 or not isinstance(bad, list), "a flag was set despite the error"
    finally:
        os.close(r)
        os.close(w)


def test_wait_flag_sees_a_byte_set_by_another_thread():
    flag = bytearray(1)
    assert not spin.wait_flag(flag, 5 * MS)

    def setter() -> None:
        time.sleep(0.01)
        flag[0] = 1

    threading.Thread(target=setter).start()
    t0 = time.monotonic()
    assert spin.wait_flag(flag, 2000 * MS)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(ValueError, match="empty"):
        spin._spin.wait_flag(bytearray(0), MS)


def test_a_spin_releases_the_gil():
    """Another Python thread keeps running while this one spins: the spin holds no GIL
    (a Python polling loop would starve it)."""
    count = [0]
    stop = threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=counter)
    t.start()
    try:
        time.sleep(0.01)
        before = count[0]
        spin.wait_flag(bytearray(1), 100 * MS)
        assert count[0] - before > 1000, "the other thread made no progress during the spin"
    finally:
        stop.set()
        t.join()


def test_default_window_env_and_core_count(monkeypatch):
    monkeypatch.delenv(spin.ENV, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert spin.default_spin_us() == 0, "a 2-core host must not spin by default"
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert spin.default_spin_us() == spin.DEFAULT_SPIN_US
    monkeypatch.setenv(spin.ENV, "500")
    assert spin.default_spin_us() == 500
    for bad in ("fast", "-3"):
        monkeypatch.setenv(spin.ENV, bad)
        with pytest.raises(ValueError, match="expected an integer >= 0") as e:
            spin.default_spin_us()
        assert f"{spin.ENV}={bad!r}" in str(e.value)


def test_config_key_reaches_the_ipc_plane_and_is_refused_elsewhere():
    base = {"role": "consumer", "consumer": {"producers": ["tcp://127.0.0.1:5557"]}}
    cfg = DisaggConfig.from_dict({**base, "transport": "ipc", "ipc_spin_us": 750})
    assert cfg.ipc_spin_us == 750
    assert DisaggConfig.from_dict(cfg.to_dict()) == cfg
    for top, why in (
        ({"transport": "tcp", "ipc_spin_us": 750}, "ipc data plane setting"),
        ({"transport": "ipc", "ipc_spin_us": -1}, "integer >= 0"),
        ({"transport": "ipc", "ipc_spin_us": True}, "integer >= 0"),
    ):
        with pytest.raises(ConfigError, match=why) as e:
            DisaggConfig.from_dict({**base, **top})
        assert e.value.field == "ipc_spin_us"
    plane = make_data_plane("ipc", ipc_spin_us=750)
    try:
        assert plane._spin_ns == 750_000  # type: ignore[attr-defined]
    finally:
        plane.close()
    with pytest.raises(ValueError, match="ipc_spin_us"):
        make_data_plane("tcp", ipc_spin_us=750)


@pytest.fixture
def spinning():
    made: list[IpcDataPlane] = []

    def make(spin_us: int = 2000) -> IpcDataPlane:
        made.append(IpcDataPlane(spin_us=spin_us))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_spinning_planes_land_many_pushes_exactly(spinning):
    """Pushes back to back and several in flight, every thread spinning between them."""
    rx, tx = spinning(), spinning()
    slab = tx.register_source(
        torch.randint(
            0, 256, (512, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
        ).to(DEVICE)
    )
    pool = torch.zeros((1024, 64), dtype=torch.uint8, device=DEVICE)
    rx.register_regions([[pool]])
    g = np.random.default_rng(2)
    tid = 0
    for depth in (1, 1, 4, 1, 8):
        pushes = []
        free = g.permutation(1024)  # a round's pushes write disjoint slots
        for k in range(depth):
            tid += 1
            rows = g.permutation(512)[:100]
            slots = free[100 * k : 100 * (k + 1)]
            rx.expect(tid, 1, b"t", [100], 10.0, [slots.tolist()])
            pushes.append(
                (
                    tid,
                    rows,
                    slots,
                    tx.post_push(
                        rx.endpoint, tid, 1, b"t", [(0, StoreRows(slab, rows, ((0, 64),)), slots)]
                    ),
                )
            )
        for t, rows, slots, h in pushes:
            assert tx.wait_push(h, 10).done and rx.wait(t, 10).state is TransferState.DONE
            assert torch.equal(
                pool[torch.from_numpy(slots).to(DEVICE)], slab[torch.from_numpy(rows).to(DEVICE)]
            )
    assert tx.stats["push_done"] == tid


def test_a_waiter_is_woken_by_an_answer_that_comes_after_its_spin(spinning):
    """The receiver starts 0.3 s after the push (far beyond a 1 ms window): the waiter
    spun, then slept, and is still woken by the ack; so is the sender thread, which had
    stopped spinning long before."""
    tx = spinning(1000)
    slab = tx.register_source(torch.arange(64, dtype=torch.uint8).reshape(4, 16).to(DEVICE))
    path = f"/tmp/disagg-test-spin-{os.getpid()}.sock"
    h = tx.post_push(f"ipc://{path}", 7, 1, b"t", [(0, slab[1:2], [3])], deadline_s=10)
    rx = IpcDataPlane(f"ipc://{path}.new", spin_us=1000)
    try:
        pool = torch.zeros((4, 16), dtype=torch.uint8, device=DEVICE)
        rx.register_regions([[pool]])
        rx.expect(7, 1, b"t", [1], 10.0)
        threading.Timer(0.3, os.rename, (f"{path}.new", path)).start()
        t0 = time.monotonic()
        assert tx.wait_push(h, 10).done
        assert 0.2 < time.monotonic() - t0 < 5, "the waiter returned before the ack, or late"
        assert torch.equal(pool[3], slab[1])
    finally:
        rx.close()
        if os.path.exists(path):
            os.unlink(path)


def test_idle_spinning_planes_burn_no_cpu(spinning):
    """After a push, the threads spin for at most their window, then sleep: the planes'
    threads use almost no CPU while the planes sit idle (their 20 ms housekeeping
    wake-ups do not restart the spin). Only their threads count: threads that earlier
    tests left in this process are not the planes under test."""
    before = set(_thread_cpu())
    rx, tx = spinning(2000), spinning(2000)
    slab = tx.register_source(torch.zeros((8, 16), dtype=torch.uint8, device=DEVICE))
    pool = torch.zeros((8, 16), dtype=torch.uint8, device=DEVICE)
    rx.register_regions([[pool]])
    rx.expect(1, 1, b"t", [2], 10.0)
    h = tx.post_push(rx.endpoint, 1, 1, b"t", [(0, slab[0:2], [4, 5])])
    assert tx.wait_push(h, 10).done
    time.sleep(0.05)  # every window is over
    wall0, threads0 = time.monotonic(), _thread_cpu()
    time.sleep(0.5)
    ticks = {k: t - threads0.get(k, 0) for k, t in _thread_cpu().items()}
    planes = sum(t for k, t in ticks.items() if k not in before)
    used = planes / os.sysconf("SC_CLK_TCK") / (time.monotonic() - wall0)
    busy = sorted(((t, k) for k, t in ticks.items()), reverse=True)[:3]
    assert used < 0.15, f"idle planes used {used:.0%} of a core; busiest threads {busy}"


def _thread_cpu() -> dict[str, int]:
    """CPU clock ticks of each thread of this process, by "tid name" (from /proc; Python's
    name for its own threads)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        name = names.get(int(task)) or stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[f"{task} {name}"] = int(fields[11]) + int(fields[12])  # utime + stime
    return out


def test_posting_threads_send_on_an_idle_connection_and_the_sender_flushes_the_rest(
    spinning,
):
    """Once a connection is up, a push leaves from the posting thread. One whose frame
    (8 MiB of indices) overflows the socket is finished by the sender thread; both land
    exactly. Spinning off here: the direct send does not depend on it."""
    rx, tx = spinning(0), spinning(0)
    n = 1 << 20
    g = np.random.default_rng(4)
    slab = tx.register_source(torch.from_numpy(g.integers(0, 256, (n, 4), dtype=np.uint8)))
    pool = torch.zeros((n, 4), dtype=torch.uint8)
    rx.register_regions([[pool]])
    rx.expect(1, 1, b"t", [1], 10.0)
    first = tx.post_push(rx.endpoint, 1, 1, b"t", [(0, slab[5:6], [9])])
    assert tx.wait_push(first, 10).done and tx.stats["push_sent_direct"] == 0  # connecting
    rows, slots = g.permutation(n), g.permutation(n)
    rx.expect(2, 1, b"t", [n], 30.0, [slots.tolist()])
    big = tx.post_push(rx.endpoint, 2, 1, b"t", [(0, StoreRows(slab, rows, ((0, 4),)), slots)])
    assert tx.stats["push_sent_direct"] == 1
    assert tx.wait_push(big, 30).done and rx.wait(2, 30).done
    assert torch.equal(pool[torch.from_numpy(slots)], slab[torch.from_numpy(rows)])
