"""Scatter-gather sends (ucx/iov.py): the ctypes mirror of ucp.h, the iov builder, and
pushes of StoreRows between two processes landing byte-exactly, with and without the
iov path (fallback: gather). Skipped without ucxx."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
from harness import pattern_rows, spawn_context

pytest.importorskip(
    "disagg.transport.ucx.plane", reason="ucxx is not installed (pip install disagg[ucx])"
)
from disagg.transport.dataplane import StoreRows  # noqa: E402
from disagg.transport.ucx import iov, settings  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def _ucp_include() -> str | None:
    try:
        import libucx
    except ImportError:
        return None
    inc = os.path.join(os.path.dirname(libucx.__file__), "include")
    return inc if os.path.exists(os.path.join(inc, "ucp", "api", "ucp.h")) else None


def test_loads_on_this_install():
    assert iov.available(), iov.unavailable_reason()


def test_request_param_layout_matches_ucp_h(tmp_path):
    """The ctypes struct against a C compile of the installed header (skipped when no
    compiler or header is around; the product never compiles anything)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    inc = _ucp_include()
    if cc is None or inc is None:
        pytest.skip("no C compiler or ucp.h")
    fields = list(iov.PARAM_LAYOUT)
    src = tmp_path / "probe.c"
    src.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include <ucp/api/ucp.h>\nint main(void){\n"
        'printf("%zu %zu %zu %d %d %d %lu\\n", sizeof(ucp_request_param_t), '
        "sizeof(ucp_dt_iov_t), sizeof(ucs_status_t), UCP_OP_ATTR_FIELD_DATATYPE, "
        "UCP_OP_ATTR_FIELD_MEMORY_TYPE, UCS_MEMORY_TYPE_HOST, "
        "(unsigned long)ucp_dt_make_iov());\n"
        + "".join(f'printf("%zu\\n", offsetof(ucp_request_param_t, {f}));\n' for f in fields)
        + "return 0;}\n"
    )
    exe = tmp_path / "probe"
    subprocess.run([cc, f"-I{inc}", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    size, iov_size, status_size, f_dt, f_mt, host, dt_iov = map(int, out[:7])
    assert size == iov.PARAM_SIZE
    assert iov_size == iov.IOV_ENTRY_SIZE
    assert status_size == 1  # read as int8 (ctypes.c_int8)
    assert (f_dt, f_mt, host, dt_iov) == (1 << 3, 1 << 6, 0, 2)
    assert dict(zip(fields, map(int, out[7:]))) == iov.PARAM_LAYOUT


def test_iov_entries_merge_adjacent_spans():
    # full-width rows: adjacent rows merge into one entry
    e = iov.iov_entries(1000, 100, np.array([3, 4, 5, 9, 2]), ((0, 100),))
    assert e.tolist() == [[1300, 300], [1900, 100], [1200, 100]]
    # two columns making the whole row: the same
    e = iov.iov_entries(1000, 100, np.array([3, 4]), ((0, 40), (40, 60)))
    assert e.tolist() == [[1300, 200]]
    # a column of a row (not full width): one entry per page, even for adjacent rows
    e = iov.iov_entries(0, 100, np.array([1, 2]), ((10, 30),))
    assert e.tolist() == [[110, 30], [210, 30]]
    # columns out of order inside a page: never merged across the jump
    e = iov.iov_entries(0, 100, np.array([1]), ((50, 50), (0, 50)))
    assert e.tolist() == [[150, 50], [100, 50]]
    assert iov.iov_entries(0, 100, np.array([], dtype=np.int64), ((0, 100),)).shape == (0, 2)


SLOTS = 96


def _slab(rows: int, width: int) -> torch.Tensor:
    return torch.from_numpy(pattern_rows(rows, width))


# the hardened tcp settings (settings.TCP_HARDENING: a tcp plane's own default) given by
# an operator: UCX sends iov messages zero-copy
HARDENED = {
    "UCX_TCP_PUT_ENABLE": "n",
    "UCX_RNDV_SCHEME": "am",
    "UCX_TCP_TX_SEG_SIZE": "2m",
    "UCX_TCP_RX_SEG_SIZE": "2m",
}
# put rendezvous in UCX's 8 KiB tcp segments, chosen by an operator
PUT = {"UCX_TCP_PUT_ENABLE": "y", "UCX_RNDV_SCHEME": "put_zcopy"}


def _apply_env(env):
    """Spawned children inherit the test process's environment: set exactly what this
    case asks for."""
    for k in list(HARDENED) + ["DISAGG_UCX_TCP_IOV"]:
        os.environ.pop(k, None)
    os.environ.update(env or {})


def _receiver(channel, pb, expected, q_out, q_in, env=None):
    # the iov sends are what is tested: a receiver that does not offer RMA reads (an
    # RMA-capable shm receiver reads StoreRows itself, test_ucx_rma.py)
    _apply_env(env)
    os.environ["DISAGG_UCX_RMA"] = "0"
    from disagg.transport.ucx.plane import UcxDataPlane

    plane = UcxDataPlane(channel=channel)
    pool = torch.zeros(SLOTS, pb, dtype=torch.uint8)
    plane.register_regions([[pool]])
    plane.expect(7, 3, b"tok", [expected], 20)
    q_out.put((plane.endpoint, plane.capabilities))
    st = plane.wait(7, 30)
    q_out.put((st.state.value, st.error, pool.numpy().copy()))
    q_in.get(timeout=30)
    plane.close()


def _sender(endpoint, caps, width, rows, cols, dst, iov_on, q_out, env=None):
    _apply_env(env)
    if not iov_on:
        os.environ["DISAGG_UCX_IOV"] = "0"
    from disagg.transport.ucx.plane import UcxDataPlane

    plane = UcxDataPlane(channel="shm" if endpoint.startswith("ucx+shm") else "tcp")
    slab = _slab(2 * SLOTS, width)
    src = StoreRows(slab, np.asarray(rows, dtype=np.int64), cols)
    h = plane.post_push(endpoint, 7, 3, b"tok", [(0, src, dst)], deadline_s=20, caps=caps)
    st = plane.wait_push(h, 30)
    # counted as posted (h.plan is emptied once the push is final: reading it after
    # post_push raced a push that finished first, under load)
    iov_msgs = plane.stats["iov_sends"]
    q_out.put((st.state.value, st.error, iov_msgs, iov.available(), plane.tcp_iov_sends))
    plane.close()


def _push(channel, width, rows, cols, dst, iov_on=True, env=None):
    pb = sum(c for _, c in cols)
    ctx = spawn_context()
    q_r, q_s, q_in = ctx.Queue(), ctx.Queue(), ctx.Queue()
    expected = sum(1 for d in dst if d >= 0)
    r = ctx.Process(target=_receiver, args=(channel, pb, expected, q_r, q_in, env))
    r.start()
    ep, caps = q_r.get(timeout=30)
    s = ctx.Process(target=_sender, args=(ep, caps, width, rows, cols, dst, iov_on, q_s, env))
    s.start()
    rx = q_r.get(timeout=60)
    tx = q_s.get(timeout=60)
    q_in.put(None)
    for p in (s, r):
        p.join(15)
        if p.is_alive():
            p.kill()
    return rx, tx


def _expect(width, rows, cols, dst, pb):
    slab = _slab(2 * SLOTS, width).numpy()
    want = np.zeros((SLOTS, pb), dtype=np.uint8)
    for r, d in zip(rows, dst):
        if d >= 0:
            want[d] = np.concatenate([slab[r, o : o + c] for o, c in cols])
    return want


@pytest.mark.parametrize("channel", ["tcp", "shm"])
@pytest.mark.parametrize("iov_on", [True, False])
def test_store_rows_land_byte_exact(channel, iov_on):
    """Random store rows into random slots (some skipped), 4 KiB pages packed into one
    segment, plus a run of adjacent rows: iov sends (shm), or numpy gathers (tcp, and
    the fallback when iov sends are off) land every byte where it belongs."""
    rng = np.random.default_rng(5)
    width = 4096
    rows = np.concatenate([rng.permutation(2 * SLOTS)[:60], np.arange(10, 30)])
    dst = rng.permutation(SLOTS)[:80]
    dst[[3, 17]] = -1
    cols = ((0, width),)
    (state, err, pool), (tstate, terr, iov_msgs, avail, tcp_iov) = _push(
        channel, width, rows.tolist(), cols, dst.tolist(), iov_on
    )
    assert (state, err) == ("done", None), err
    assert (tstate, terr) == ("done", None), terr
    assert avail is iov_on
    # iov sends on shm, and over tcp only with large tcp segments (with UCX's default tcp
    # settings it cuts them into 8 KiB copies: gathers into the send ring)
    assert (iov_msgs > 0) is (iov_on and (channel == "shm" or tcp_iov))
    np.testing.assert_array_equal(pool, _expect(width, rows, cols, dst, width))


@pytest.mark.parametrize("channel", ["tcp", "shm"])
def test_store_rows_columns_of_a_row(channel):
    """Pages made of two column spans of wider rows (out of order): one iov entry per
    span on shm, a per-column numpy gather over tcp."""
    rng = np.random.default_rng(6)
    width = 3000
    cols = ((2000, 700), (100, 1300))
    rows = rng.permutation(2 * SLOTS)[:40]
    dst = rng.permutation(SLOTS)[:40]
    (state, err, pool), (tstate, terr, iov_msgs, _, tcp_iov) = _push(
        channel, width, rows.tolist(), cols, dst.tolist()
    )
    assert (state, err) == ("done", None), err
    assert (tstate, terr) == ("done", None), terr
    assert (iov_msgs > 0) is (channel == "shm" or tcp_iov)
    np.testing.assert_array_equal(pool, _expect(width, rows, cols, dst, 2000))


@pytest.mark.parametrize(
    "env, want_iov",
    [
        ({}, True),  # the plane's own settings (TCP_HARDENING): iov sends
        (HARDENED, True),  # the same from the operator
        ({**HARDENED, "DISAGG_UCX_TCP_IOV": "0"}, False),  # forced off: the ring
        (PUT, False),  # UCX's 8 KiB tcp segments: the ring
        ({**PUT, "DISAGG_UCX_TCP_IOV": "1"}, True),  # forced on (slow, but correct)
    ],
    ids=["default", "hardened", "hardened-forced-off", "put", "put-forced-on"],
)
def test_tcp_iov_sends_with_large_segments(env, want_iov):
    """Over tcp, scattered 64 KiB store rows (2 MiB segments of 32 iov entries, the
    zero-copy rendezvous of large tcp segments; a run of adjacent rows; skipped pages)
    go as iov messages exactly when the sender's context has large tcp segments (or
    ``DISAGG_UCX_TCP_IOV`` says so), and land byte-exactly either way."""
    rng = np.random.default_rng(8)
    width = 64 << 10
    rows = np.concatenate([rng.permutation(2 * SLOTS)[:70], np.arange(150, 170)])
    dst = rng.permutation(SLOTS)[:90]
    dst[[0, 33, 89]] = -1
    cols = ((0, width),)
    (state, err, pool), (tstate, terr, iov_msgs, avail, tcp_iov) = _push(
        "tcp", width, rows.tolist(), cols, dst.tolist(), env=env
    )
    assert (state, err) == ("done", None), err
    assert (tstate, terr) == ("done", None), terr
    assert avail
    assert tcp_iov is want_iov
    if want_iov:
        # 87 pages in 2 MiB segments: 3 segments, none of them one span of the slab
        assert iov_msgs == 3
    else:
        assert iov_msgs == 0
    np.testing.assert_array_equal(pool, _expect(width, rows, cols, dst, width))


def test_large_segments_read_from_config_and_environment(monkeypatch):
    """``tcp_large_segments``: active-message rendezvous and a tcp send segment of at
    least 2 MiB, each from the context's config dict (which wins, as in UCX) or else
    the environment; ``tcp_iov_default`` follows it unless DISAGG_UCX_TCP_IOV is set."""
    large, default = settings.tcp_large_segments, settings.tcp_iov_default
    for k in list(HARDENED) + ["DISAGG_UCX_TCP_IOV"]:
        monkeypatch.delenv(k, raising=False)
    assert not large({})
    cfg = {"RNDV_SCHEME": "am", "TCP_TX_SEG_SIZE": "2m"}
    assert large(cfg)
    assert large({"RNDV_SCHEME": "AM", "TCP_TX_SEG_SIZE": "4MB"})
    assert large({"RNDV_SCHEME": "am", "TCP_TX_SEG_SIZE": str(2 << 20)})
    assert not large({"RNDV_SCHEME": "am", "TCP_TX_SEG_SIZE": "1m"})
    assert not large({"RNDV_SCHEME": "am", "TCP_TX_SEG_SIZE": "8K"})
    assert not large({"RNDV_SCHEME": "put_zcopy", "TCP_TX_SEG_SIZE": "2m"})
    assert not large({"RNDV_SCHEME": "am"})  # UCX's 8 KiB default segment
    for k, v in HARDENED.items():
        monkeypatch.setenv(k, v)
    assert large({}) and default({})
    assert not large({"RNDV_SCHEME": "put_zcopy"})  # the config dict wins
    assert not large({"TCP_TX_SEG_SIZE": "64k"})
    monkeypatch.setenv("DISAGG_UCX_TCP_IOV", "0")
    assert not default({})
    monkeypatch.setenv("UCX_RNDV_SCHEME", "put_zcopy")
    assert not default({})
    monkeypatch.setenv("DISAGG_UCX_TCP_IOV", "1")
    assert default({})


def test_store_rows_bad_input_named():
    from disagg.transport.ucx.plane import UcxDataPlane

    plane = UcxDataPlane(channel="tcp")
    try:
        slab = _slab(8, 64)
        bad = StoreRows(slab, np.array([1, 8]), ((0, 64),))
        with pytest.raises(ValueError, match="source rows outside"):
            plane.post_push("ucx+tcp://127.0.0.1:1", 1, 1, b"t", [(0, bad, [0, 1])])
        bad = StoreRows(slab, np.array([1, 2]), ((10, 64),))
        with pytest.raises(ValueError, match="columns"):
            plane.post_push("ucx+tcp://127.0.0.1:1", 1, 1, b"t", [(0, bad, [0, 1])])
        bad = StoreRows(slab, np.array([1, 2, 3]), ((0, 64),))
        with pytest.raises(ValueError, match="3 source rows for 2"):
            plane.post_push("ucx+tcp://127.0.0.1:1", 1, 1, b"t", [(0, bad, [0, 1])])
    finally:
        plane.close()
