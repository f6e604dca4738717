"""The DataPlane contract (``disagg/transport/dataplane.py``), checked the same way on
every plane through its public API alone: ``make_data_plane``, ``register_regions``,
``endpoint``, ``capabilities``, ``expect`` / ``poll`` / ``wait`` / ``abort`` on the
receiver, ``post_push(..., caps=rx.capabilities)`` / ``poll_push`` on the sender,
``close``; and, where a plane has it, ``register_source`` (what the producer calls on
its store) and ``add_source`` (what the consumer calls with the producer's
``source_caps`` at the handshake). Planes: tcp over TCP and over a Unix socket, ipc, UCX
over tcp and over shm (skipped without ucxx), NIXL's UCX over tcp and over whatever it
picks on one host (shared memory; skipped without NIXL).

Receivers' pools start zeroed and sources are random bytes, so ``check_landed`` (every
promised slot holds its page, every other slot still zero) shows exactly where bytes
went."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from test_transport_dataplane import check_landed, rand

from disagg.transport.dataplane import DataPlane, push_source
from disagg.transport.factory import make_data_plane

pytestmark = pytest.mark.timeout(60)

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
WIDTH = 4096  # bytes per page: small pages keep the file fast
SLOTS = 64
COLS = ((0, WIDTH),)
_no_ucx = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed (disagg[ucx])"
)
_no_nixl = pytest.mark.skipif(
    all(importlib.util.find_spec(m) is None for m in ("nixl_cu12", "nixl_cu13", "nixl")),
    reason="NIXL is not installed (disagg[nixl])",
)
PLANES = [
    pytest.param(("tcp", "tcp"), id="tcp-tcp"),
    pytest.param(("tcp", "unix"), id="tcp-unix"),
    pytest.param(("ipc", None), id="ipc"),
    pytest.param(("ucx", "tcp"), id="ucx-tcp", marks=_no_ucx),
    pytest.param(("ucx", "shm"), id="ucx-shm", marks=_no_ucx),
    pytest.param(("nixl", "tcp"), id="nixl-tcp", marks=[_no_nixl, pytest.mark.nixl]),
    pytest.param(("nixl", "shm"), id="nixl-shm", marks=[_no_nixl, pytest.mark.nixl]),
]

Make = Callable[[], DataPlane]


def _plane(kind: str, channel: str | None, sock_dir: str, n: int) -> DataPlane:
    if kind == "tcp" and channel == "unix":
        return make_data_plane("tcp", bind=f"ipc://{sock_dir}/plane{n}.sock")
    if kind == "ucx":
        return make_data_plane("ucx", ucx_channel=channel)
    if kind == "nixl":  # UCX's transports for this plane alone; shm: UCX picks (cma here)
        from disagg.transport.nixl.plane import NixlDataPlane

        return NixlDataPlane(transports="tcp,self" if channel == "tcp" else None)
    return make_data_plane(kind)


@pytest.fixture(params=PLANES)
def plane_kind(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    return request.param


@pytest.fixture
def make(plane_kind: tuple[str, str | None], tmp_path: Any) -> Iterator[Make]:
    """Planes of this parameter's kind, closed after the test."""
    made: list[DataPlane] = []

    def new() -> DataPlane:
        made.append(_plane(*plane_kind, str(tmp_path), len(made)))
        return made[-1]

    yield new
    for p in made:
        t0 = time.monotonic()
        p.close()
        # a peer that died mid-message must not hold the plane's thread (a UCX header
        # receive from a killed sender once spun forever: close waited 10 s, then left
        # the thread spinning)
        assert time.monotonic() - t0 < 5.0, f"{plane_kind} close took {time.monotonic() - t0:.1f}s"


def _store(plane: DataPlane, rows: int, seed: int) -> torch.Tensor:
    """A random source slab, made readable the way the producer does it."""
    slab = rand(rows, WIDTH, seed)
    register = getattr(plane, "register_source", None)
    return register(slab) if register is not None else slab


def _push(
    tx: DataPlane,
    rx: DataPlane,
    tid: int,
    slab: torch.Tensor,
    rows: list[int],
    slots: list[int],
    token: bytes = b"tok",
    lease: int = 7,
    deadline_s: float = 20.0,
) -> Any:
    rx.add_source(tx.source_caps)  # the handshake (the producer's HelloOk)
    pages, dst = push_source(tx, slab, rows, COLS, slots)
    return tx.post_push(
        rx.endpoint, tid, lease, token, [(0, pages, dst)], deadline_s, caps=rx.capabilities
    )


def _pool(rx: DataPlane, slots: int = SLOTS) -> torch.Tensor:
    pool = torch.zeros((slots, WIDTH), dtype=torch.uint8)
    rx.register_regions([[pool]])
    return pool


def _expected(slab: torch.Tensor, rows: list[int], slots: list[int], n: int) -> torch.Tensor:
    """Pool contents once ``rows`` of ``slab`` landed in ``slots`` of a zeroed pool."""
    want = torch.zeros((n, WIDTH), dtype=torch.uint8)
    want[torch.tensor(slots)] = slab[torch.tensor(rows)]
    return want


def test_exact_bytes_land_in_the_promised_slots_and_nowhere_else(make):
    rx, tx = make(), make()
    pool = _pool(rx)
    slab = _store(tx, 48, seed=1)
    rng = np.random.default_rng(1)
    rows = rng.choice(48, 20, replace=False).tolist()
    slots = rng.choice(SLOTS, 20, replace=False).tolist()
    rx.expect(1, 7, b"tok", [20], 20.0, [slots])
    h = _push(tx, rx, 1, slab, rows, slots)
    st = rx.wait(1, 20.0)
    assert st.done, st
    assert st.pages == 20 and st.nbytes == 20 * WIDTH
    assert tx.wait_push(h, 20.0).done, tx.poll_push(h)
    check_landed(pool, slab[torch.tensor(rows)], slots)


@pytest.mark.parametrize("forgery", ["wrong_token", "slot_not_given", "slot_outside"])
def test_a_forged_push_is_refused_and_writes_nothing(make, forgery):
    """A wrong token, or a slot outside the transfer's promised set (one of the pool's
    slots that was not given, or one beyond the pool), writes no byte anywhere; a push
    with a wrong token leaves the real transfer free to complete."""
    rx, tx = make(), make()
    pool = _pool(rx)
    slab = _store(tx, 8, seed=2)
    given = [0, 1, 2, 3]
    rx.expect(2, 7, b"tok", [4], 30.0, [given])
    slots = {
        "wrong_token": given,
        "slot_not_given": [0, 1, 2, 9],
        "slot_outside": [0, 1, 2, SLOTS],
    }[forgery]
    token = b"forged" if forgery == "wrong_token" else b"tok"
    # the sender may never hear back from a receiver that drops its push: a short deadline
    # (the push reaches the receiver within ms)
    h = _push(tx, rx, 2, slab, [0, 1, 2, 3], slots, token=token, deadline_s=1.0)
    if forgery == "wrong_token":
        tx.wait_push(h, 3.0)
        time.sleep(0.2)  # what the forged push would have written had it been taken
        assert not pool.any(), "a push with a wrong token wrote bytes"
        assert not rx.poll(2).final, rx.poll(2)
        h = _push(tx, rx, 2, slab, [4, 5, 6, 7], given)
        assert rx.wait(2, 20.0).done, rx.poll(2)
        check_landed(pool, slab[4:8], given)
    else:
        st = rx.wait(2, 20.0)
        assert st.failed, st
        time.sleep(0.2)
        assert not pool.any(), "a push to a slot outside the transfer wrote bytes"


def test_deadline_without_a_sender_fails(make):
    rx = make()
    pool = _pool(rx)
    rx.expect(3, 7, b"tok", [2], 0.3, [[5, 6]])
    t0 = time.monotonic()
    st = rx.wait(3, 10.0)
    assert st.failed and "deadline" in (st.error or ""), st
    assert time.monotonic() - t0 < 5.0
    assert not pool.any()


def test_concurrent_transfers_each_land_exactly(make):
    """Four transfers from two senders in flight at once, into disjoint slots."""
    rx, senders = make(), [make(), make()]
    pool = _pool(rx)
    slabs = [_store(tx, 32, seed=10 + i) for i, tx in enumerate(senders)]
    rng = np.random.default_rng(4)
    slots = rng.permutation(SLOTS)[:48].reshape(4, 12).tolist()
    rows = [rng.choice(32, 12, replace=False).tolist() for _ in range(4)]
    for tid in range(4):
        rx.expect(10 + tid, 7, b"tok", [12], 30.0, [slots[tid]])
    handles = [
        (
            senders[tid % 2],
            _push(senders[tid % 2], rx, 10 + tid, slabs[tid % 2], rows[tid], slots[tid]),
        )
        for tid in range(4)
    ]
    for tid in range(4):
        assert rx.wait(10 + tid, 30.0).done, rx.poll(10 + tid)
    for tx, h in handles:
        assert tx.wait_push(h, 30.0).done, tx.poll_push(h)
    want = torch.zeros_like(pool)
    for tid in range(4):
        want += _expected(slabs[tid % 2], rows[tid], slots[tid], SLOTS)
    assert torch.equal(pool, want)


# ------------------------------------------------------------------ a sender that dies
DEATH_PAGES = 16384  # 64 MiB: a push that takes long enough to be killed in the middle


def _doomed_sender(
    kind: str, channel: str | None, sock_dir: str, die_at_once: bool, q_in: Any, q_out: Any
) -> None:
    """Post one push to the receiver named on ``q_in``; then die at once (SIGKILL), or
    wait there for the test to kill it."""
    tx = _plane(kind, channel, sock_dir, 99)
    slab = _store(tx, DEATH_PAGES, seed=5)
    q_out.put(("ready", tx.source_caps))
    endpoint, caps = q_in.get(timeout=60)
    rows = list(range(DEATH_PAGES))
    pages, dst = push_source(tx, slab, rows, COLS, rows)
    tx.post_push(endpoint, 20, 7, b"tok", [(0, pages, dst)], 30.0, caps=caps)
    if die_at_once:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


@pytest.fixture(scope="module")
def children() -> Any:
    """Child processes forked from one server that has imported torch and disagg already
    (a spawned child would import them again for every case)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "disagg.transport.factory", __name__])
    return ctx


def test_a_sender_killed_mid_push_ends_the_transfer_by_its_deadline(
    make, plane_kind, children, tmp_path
):
    """The sender process is killed in the middle of its push: on the planes that stream
    pages from the sender (and NIXL over tcp, where the receiver's reads need the
    sender's progress), once the receiver has landed some of them; on the ipc plane (one
    message, then the receiver copies) and NIXL on one host (the receiver's reads copy
    from the sender's memory themselves) right after ``post_push``. The transfer is
    final by its deadline, and FAILED unless every page had been handed over before the
    kill (bytes in the kernel's socket buffers, or, on the ipc plane, a push that reached
    its receiver: it copies from the sender's /dev/shm export, which outlives the
    sender): DONE only with every page exact. After ``abort`` no byte of it is
    written. A streamed push that lands whole before the kill (a quiet host, a plane that
    reports pages only as large receives complete) did not test a death: it is run again,
    and the last try kills the sender right after ``post_push``, as on the ipc plane."""
    streams = plane_kind[0] != "ipc" and plane_kind != ("nixl", "shm")
    for attempt in range(3):
        wait_pages = streams and attempt < 2
        if _kill_mid_push(make, plane_kind, children, tmp_path / str(attempt), wait_pages):
            return
    pytest.fail("the push landed whole before its sender was killed, every time")


def _kill_mid_push(make, plane_kind, children, tmp_path, streams) -> bool:
    """One run of the case above (``streams``: kill once pages have landed, else right
    after ``post_push``); False when the push finished before the kill."""
    tmp_path.mkdir()
    rx = make()
    pool = _pool(rx, DEATH_PAGES)
    q_in, q_out = children.Queue(), children.Queue()
    args = (*plane_kind, str(tmp_path), not streams, q_in, q_out)
    child = children.Process(target=_doomed_sender, args=args)
    child.start()
    try:
        ready, source_caps = q_out.get(timeout=50)
        assert ready == "ready"
        rx.add_source(source_caps)
        deadline_s = 1.5  # its first pages land within 0.2 s of the endpoint
        rx.expect(20, 7, b"tok", [DEATH_PAGES], deadline_s, [list(range(DEATH_PAGES))])
        t0 = time.monotonic()
        q_in.put((rx.endpoint, rx.capabilities))
        if streams:
            while rx.poll(20).pages == 0 and not rx.poll(20).final:
                time.sleep(0.0002)
            child.kill()
            st = rx.poll(20)
            if st.final:
                assert st.done and torch.equal(pool, rand(DEATH_PAGES, WIDTH, 5)), st
                return False
        st = rx.wait(20, deadline_s + 5.0)
        assert st.final and time.monotonic() - t0 < deadline_s + 5.0, st
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
        if st.done:
            assert torch.equal(pool, rand(DEATH_PAGES, WIDTH, 5)), "DONE with wrong pages"
            return True
        assert rx.abort(20, "sender gone") == 0
        after = pool.clone()
        time.sleep(0.3)
        assert torch.equal(pool, after), "bytes landed after abort"
        return True
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)
