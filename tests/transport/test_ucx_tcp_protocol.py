"""A host tcp plane's UCX protocol (ucx/settings.py ``TCP_HARDENING``): the tcp put off,
active-message rendezvous, 2 MiB socket segments. A sender on the put protocol (put
rendezvous, the put on, UCX's 8 KiB segments: what an operator's
``UCX_TCP_PUT_ENABLE=y UCX_RNDV_SCHEME=put_zcopy`` gives) still pushes to a hardened
receiver; a hardened sender refuses, at once and by name, a receiver whose capabilities
say it runs 8 KiB tcp segments (its 2 MiB fragments would never be taken there: the push
would only miss its deadline). Each pair moves packed 64 KiB pages and direct 1 MiB runs
between two processes, byte for byte. Skipped without ucxx."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from harness import pattern_rows, spawn_context

pytest.importorskip(
    "disagg.transport.ucx.plane", reason="ucxx is not installed (pip install disagg[ucx])"
)
from disagg.transport.dataplane import StoreRows  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SLOTS = 64
PUT = {"UCX_TCP_PUT_ENABLE": "y", "UCX_RNDV_SCHEME": "put_zcopy"}
# the hardening given by an operator (the plane then sets none of it, and its receive
# segments are still 2 MiB)
OPERATOR = {
    "UCX_TCP_PUT_ENABLE": "n",
    "UCX_RNDV_SCHEME": "am",
    "UCX_TCP_TX_SEG_SIZE": "2m",
    "UCX_TCP_RX_SEG_SIZE": "2m",
}
# (page bytes, pages): packed into 2 MiB segments; runs of 1 MiB sent in place
SHAPES = [(64 << 10, 40), (1 << 20, 12)]


def _slab(rows: int, pb: int, salt: int) -> torch.Tensor:
    return torch.from_numpy(pattern_rows(rows, pb, salt))


def _plane(env: dict[str, str]):
    os.environ.update(env)  # before the plane's import: as an operator's environment
    from disagg.transport.ucx import settings
    from disagg.transport.ucx.plane import UcxDataPlane

    plane = UcxDataPlane(channel="tcp")
    return plane, settings.exposure_config("tcp", "127.0.0.1")


def _receiver(env, counts, q_out, q_in):
    plane, cfg = _plane(env)
    pools = [torch.zeros(SLOTS, pb, dtype=torch.uint8) for pb, _ in SHAPES]
    plane.register_regions([[p] for p in pools])
    q_out.put((plane.endpoint, plane.capabilities, cfg))
    for tid, n in enumerate(counts, 1):
        plane.expect(tid, 3, b"tok", [n if g == tid - 1 else 0 for g in range(2)], 60)
    for tid in range(1, len(SHAPES) + 1):
        st = plane.wait(tid, 60)
        q_out.put((st.state.value, st.error))
    q_out.put([p.numpy().copy() for p in pools])
    q_in.get(timeout=60)
    plane.close()


def _sender(env, ep, caps, plan, q_out, q_go):
    plane, cfg = _plane(env)
    out = []
    for tid, ((pb, _), (rows, dst)) in enumerate(zip(SHAPES, plan), 1):
        src = StoreRows(_slab(2 * SLOTS, pb, tid), np.asarray(rows, dtype=np.int64), ((0, pb),))
        groups = [(tid - 1, src, dst)]
        try:
            h = plane.post_push(ep, tid, 3, b"tok", groups, deadline_s=60, caps=caps)
        except ValueError as exc:
            out.append(("refused", str(exc)))
            continue
        st = plane.wait_push(h, 60)
        out.append((st.state.value, st.error))
    q_out.put((out, cfg))
    q_go.get(timeout=60)
    plane.close()


def _pair(rx_env, tx_env, with_landing=True):
    """Push SHAPES from a sender with ``tx_env`` to a receiver with ``rx_env``: (what the
    receiver's transfers ended as or None, its pools, the sender's results, both configs,
    the plan)."""
    rng = np.random.default_rng(21)
    plan = []
    for _, n in SHAPES:
        rows, dst = rng.permutation(2 * SLOTS)[:n], rng.permutation(SLOTS)[:n]
        dst[3] = -1  # a page the consumer skips
        plan.append((rows.tolist(), dst.tolist()))
    counts = [sum(d >= 0 for d in dst) for _, dst in plan]
    ctx = spawn_context()
    q_r, q_s, q_in, q_go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    r = ctx.Process(target=_receiver, args=(rx_env, counts, q_r, q_in))
    r.start()
    s = None
    try:
        ep, caps, rx_cfg = q_r.get(timeout=30)
        s = ctx.Process(target=_sender, args=(tx_env, ep, caps, plan, q_s, q_go))
        s.start()
        sent, tx_cfg = q_s.get(timeout=60)
        landed = pools = None
        if with_landing:
            landed = [q_r.get(timeout=60) for _ in SHAPES]
            pools = q_r.get(timeout=60)
    finally:
        q_in.put(None)
        q_go.put(None)
        if not with_landing:
            r.kill()  # it waits for transfers that never come
        for p in (r, s):
            if p is not None:
                p.join(15)
                if p.is_alive():
                    p.kill()
    return landed, pools, sent, (rx_cfg, tx_cfg), plan


@pytest.mark.parametrize(
    "rx_env,tx_env",
    [({}, {}), ({}, PUT), (PUT, PUT), (OPERATOR, {}), ({}, OPERATOR)],
    ids=["hardened", "put-sender", "put", "operator-receiver", "operator-sender"],
)
def test_pushes_land_between_hardened_and_put_protocol_planes(rx_env, tx_env):
    landed, pools, sent, cfgs, plan = _pair(rx_env, tx_env)
    for env, cfg in zip((rx_env, tx_env), cfgs):  # each side ran the protocol it was meant to
        assert (cfg.get("TCP_PUT_ENABLE") == "n") == (not env), cfg
    assert landed == [("done", None)] * len(SHAPES), landed
    assert sent == [("done", None)] * len(SHAPES), sent
    for tid, ((pb, _), (rows, dst), pool) in enumerate(zip(SHAPES, plan, pools), 1):
        slab = _slab(2 * SLOTS, pb, tid).numpy()
        want = np.zeros((SLOTS, pb), dtype=np.uint8)
        keep = np.asarray(dst) >= 0
        want[np.asarray(dst)[keep]] = slab[np.asarray(rows)[keep]]
        np.testing.assert_array_equal(pool, want)


def test_a_hardened_sender_refuses_a_put_protocol_receiver_by_name():
    _, _, sent, _, _ = _pair(PUT, {}, with_landing=False)
    assert [state for state, _ in sent] == ["refused"] * len(SHAPES), sent
    assert all(
        "segments of 8192 bytes" in err and "UCX_TCP_PUT_ENABLE=y" in err for _, err in sent
    ), sent
