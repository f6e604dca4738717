"""disagg.hostmem: huge-page host tensors that fall back to plain ones, and their users
(the producer's store, the UCX plane's direct landing on shared memory)."""

from __future__ import annotations

import gc

import pytest
import torch

from disagg import hostmem

MiB = 1 << 20
THP_ON = hostmem.thp_mode() in ("always", "madvise")


@pytest.mark.parametrize(
    "shape,dtype",
    [((4, MiB), torch.uint8), ((3, 5, 1 << 18), torch.float32), (6 * MiB + 3, torch.uint8)],
)
def test_empty_has_shape_dtype_and_holds_data(shape, dtype):
    t = hostmem.empty(shape, dtype)
    want = (shape,) if isinstance(shape, int) else shape
    assert tuple(t.shape) == want and t.dtype == dtype and t.device.type == "cpu"
    assert t.is_contiguous()
    t.fill_(3)
    assert bool((t == 3).all())
    if THP_ON:  # big enough: one aligned mapping
        assert hostmem.is_huge(t) and t.data_ptr() % hostmem.HUGE_PAGE == 0
        assert hostmem.is_huge(t.view(-1)[4096:8192])  # a view of it too


def test_numpy_view_keeps_the_mapping_alive():
    a = hostmem.empty((4, MiB)).numpy()
    gc.collect()
    a[:] = 7  # would fault if the mapping had gone with the tensor
    assert int(a.sum()) == 7 * 4 * MiB


def test_small_buffers_are_plain():
    t = hostmem.empty((3, 100), torch.int64)
    assert tuple(t.shape) == (3, 100) and t.dtype == torch.int64
    assert not hostmem.is_huge(t)


def test_madvise_failure_falls_back(monkeypatch):
    def refuse(mm, start, length):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(hostmem, "_madvise", refuse)
    monkeypatch.setattr(hostmem, "thp_mode", lambda: "madvise")
    before = dict(hostmem._huge_ranges)
    t = hostmem.empty((8, MiB))
    assert tuple(t.shape) == (8, MiB) and t.dtype == torch.uint8
    t.fill_(1)
    assert int(t.sum()) == 8 * MiB
    assert not hostmem.is_huge(t)
    assert hostmem._huge_ranges == before  # nothing left behind


def test_thp_off_means_plain(monkeypatch):
    monkeypatch.setattr(hostmem, "thp_mode", lambda: "never")
    called = []
    monkeypatch.setattr(hostmem, "_madvise", lambda *a: called.append(a))
    t = hostmem.empty((4, MiB))
    assert tuple(t.shape) == (4, MiB) and not hostmem.is_huge(t) and not called


def test_pin_without_cuda_is_a_plain_tensor():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only path")
    t = hostmem.empty((4, MiB), pin=True)
    assert tuple(t.shape) == (4, MiB) and not t.is_pinned()


def test_huge_pages_really_back_it():
    if not THP_ON:
        pytest.skip(f"transparent huge pages are {hostmem.thp_mode()!r} here")
    before = hostmem.anon_huge_bytes()
    t = hostmem.empty((32, MiB))
    t.fill_(1)  # first touch, after the madvise
    got = hostmem.anon_huge_bytes() - before
    # the kernel may fall back to 4 KiB pages where it finds no free 2 MiB page
    assert got >= 16 * MiB, f"only {got >> 20} MiB of 32 MiB in huge pages"
    ranges = len(hostmem._huge_ranges)
    del t
    gc.collect()
    assert len(hostmem._huge_ranges) == ranges - 1  # forgotten once freed


def test_store_slab_comes_from_hostmem():
    from disagg.producer.store import BlockStore

    store = BlockStore(MiB, 8 * MiB)
    assert tuple(store.slab.shape) == (8, MiB) and store.slab.dtype == torch.uint8
    assert hostmem.is_huge(store.slab) == THP_ON


# ---- the UCX plane lands runs of >= 1 MiB straight into huge-page pools over shm ------


def _pages(n: int, pb: int) -> torch.Tensor:
    return (torch.arange(n * pb, dtype=torch.int64) * 7 // 5 % 251).to(torch.uint8).view(n, pb)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("huge", [True, False])
def test_ucx_shm_direct_into_huge_pool(monkeypatch, huge):
    pytest.importorskip("ucxx", reason="ucxx is not installed")
    from disagg.transport import receiver
    from disagg.transport.ucx import receive
    from disagg.transport.ucx.plane import UcxDataPlane

    if huge and not THP_ON:
        pytest.skip(f"transparent huge pages are {hostmem.thp_mode()!r} here")

    scatters = []  # pages landed from scratch (packed segments), by either scatter
    real = receiver.Group.scatter
    monkeypatch.setattr(
        receiver.Group, "scatter", lambda g, s, src: (scatters.append(len(s)), real(g, s, src))
    )
    real_host = receive.scatter_host
    monkeypatch.setattr(
        receive,
        "scatter_host",
        lambda g, seg, packed: (scatters.append(seg.pages), real_host(g, seg, packed)),
    )
    pb = MiB
    with UcxDataPlane(channel="shm") as rx, UcxDataPlane(channel="shm") as tx:
        pool = hostmem.empty((16, pb)) if huge else torch.empty(16, pb, dtype=torch.uint8)
        pool.zero_()
        rx.register_regions([[pool]])
        assert rx.capabilities.direct == huge
        rows = _pages(5, pb)
        dst = [3, 9, 10, 0, 14]  # rows 1-2 -> slots 9-10: one 2 MiB run
        rx.expect(1, 1, b"tok", [5], 10)
        h = tx.post_push(rx.endpoint, 1, 1, b"tok", [(0, rows, dst)], 10, rx.capabilities)
        assert tx.wait_push(h, 15).done
        st = rx.wait(1, 15)
        assert st.done, st.error
        for i, d in enumerate(dst):
            assert torch.equal(pool[d], rows[i]), (i, d)
        assert not pool[[1, 2, 4, 5, 6, 7, 8, 11, 12, 13, 15]].any()
    # direct: every run landed in place; packed (4 KiB-page pool): scattered from scratch
    assert (sum(scatters) == 0) if huge else (sum(scatters) == 5)


def test_ucx_tcp_receiver_never_asks_for_direct():
    pytest.importorskip("ucxx", reason="ucxx is not installed")
    from disagg.transport.ucx.plane import UcxDataPlane

    with UcxDataPlane(channel="tcp") as rx:
        rx.register_regions([[hostmem.empty((4, MiB))]])
        assert not rx.capabilities.direct, rx.capabilities
