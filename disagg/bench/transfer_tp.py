"""``disagg bench transfer --tp``: TP-split and TP-merge transfers beside the same-TP one,
through the real data planes, one producer process and the consumer ranks' processes per
transport and page size (docs/design/unequal-tp.md).

A page of S bytes is ``BUFFERS`` (layer, role) buffers, each the heads of its rank
head-major; the producer's store holds 2N such pages. Each repetition times, one after
the other on fresh random rows and slots (so the kinds share the same conditions):

- ``same``: N whole pages into the consumer's pool (equal TP sizes: one consumer rank,
  one process);
- ``split``: the consumer TP is twice the producer's, so a producer page serves two
  consumer ranks at once: two transfers, each reading from the same N pages one half of
  every buffer (``BUFFERS`` runs of S / 2 / BUFFERS bytes, the store columns a Push naming
  those heads gathers) into that rank's pool of S / 2-byte pages. The two ranks are two
  processes, each with its own plane and receiver, as in a deployment;
- ``split_shared``: the same two transfers landing in ONE consumer process (both ranks'
  pools registered on one plane): one receiver does both ranks' per-push work;
- ``split1``: one of those two transfers alone (a consumer rank's share: half the bytes);
- ``merge``: the consumer page holds the heads of two producer ranks: two transfers at once
  (rank A's pages are the stores' first S / 2 bytes, rank B's the second), each landing its
  S / 2 / BUFFERS-byte runs in place in every buffer of the consumer's S-byte pages (the
  slice groups ``consumer.routes`` registers).

GB/s are the bytes landed in the consumer's pages over the time to the last DONE (``same``,
``split``, ``split_shared`` and ``merge`` land N * S bytes each, ``split1`` half that; a
split's second rank stamps its DONE with ``time.perf_counter``, CLOCK_MONOTONIC, one clock
for every process of the host); ``ratio`` is the paired median over repetitions of a kind's
GB/s against that repetition's same-TP GB/s. Pages are verified: every S / 2 / BUFFERS-byte
run of a store row starts with the row's index, so each landed run is checked for the row
it came from and where it landed.

The planes, stores and process plumbing are ``transfer``'s, handed in as ``kit`` (its
``tp_kit(roles)``: ``make_plane``, ``device`` (``Roles.of``: the ``-cuda`` rows' GPUs as
``--producer-device`` / ``--consumer-device`` say; a split's second rank uses the
consumer's), ``store``, ``result``, ``unavailable``, ``spec``).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from .peers import draw
from .units import fmt_size, median

BUFFERS = 16  # (layer, role) buffers per page: 8 layers' keys and values
KINDS = ("same", "split", "split_shared", "split1", "merge")


def _columns(page_bytes: int) -> dict[str, list[tuple[int, tuple[tuple[int, int], ...]]]]:
    """Per kind, its pushes: ``(receiver group, store columns)``."""
    run, half = page_bytes // BUFFERS, page_bytes // 2
    first = tuple((b * run, run // 2) for b in range(BUFFERS))
    second = tuple((b * run + run // 2, run // 2) for b in range(BUFFERS))
    return {
        "same": [(0, ((0, page_bytes),))],
        "split": [(1, first), (0, second)],  # the second: rank B's process, its group 0
        "split_shared": [(1, first), (4, second)],
        "split1": [(1, first)],
        "merge": [(2, ((0, half),)), (3, ((half, half),))],
    }


def _stamp(store: np.ndarray, page_bytes: int) -> None:
    """Every S / 2 / BUFFERS-byte run of each store row starts with the row's index."""
    n, step = store.shape[0], page_bytes // BUFFERS // 2
    idx = np.arange(n, dtype=np.int64).view(np.uint8).reshape(n, 8)
    for at in range(0, page_bytes, step):
        store[:, at : at + 8] = idx


def _check(kind: str, target: Any, jobs: list[Any], page_bytes: int) -> None:
    """Each landed run's first word is the index of the store row it came from: for a
    merge, even runs (first halves of buffers) rank A's rows, odd runs rank B's."""
    import torch

    step = page_bytes // BUFFERS // 2 // 8  # int64 words per run
    words = target.shape[1] // 8
    dst = torch.as_tensor(np.asarray(jobs[0][3]), device=target.device)
    at = torch.arange(0, words, step, device=target.device)
    got = target.view(torch.int64)[dst[:, None], at[None, :]].cpu().numpy()
    want = np.stack([np.asarray(jobs[0][2])] * at.numel(), axis=1)
    if kind == "merge":
        want[:, 1::2] = np.asarray(jobs[1][2])[:, None]
    if not np.array_equal(got, want):
        raise RuntimeError(f"{kind}: pages landed in the wrong slots or corrupted")


def _producer(kit: Any, name: str, n: int, page_bytes: int, conn: Any) -> None:
    """Post every push of a request ("push", [(endpoint, caps, tid, group, src, dst, cols)])
    at once, wait for them, reply ("pushed", errors); until "stop"."""
    import torch

    from ..transport.dataplane import push_source

    plane = None
    try:
        store = kit.store(2 * n, page_bytes)
        _stamp(store, page_bytes)
        plane = kit.make_plane(name)
        rows = torch.from_numpy(store).to(kit.device(name, "producer"))
        register = getattr(plane, "register_source", None)
        if register is not None:  # the ipc plane shares the store (shm / CUDA IPC)
            rows = register(rows)
        conn.send(("ready", plane.source_caps))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            handles = [
                plane.post_push(
                    endpoint,
                    tid,
                    1,
                    b"bench",
                    [(group, *push_source(plane, rows, src, cols, dst))],
                    deadline_s=300,
                    caps=caps,
                )
                for endpoint, caps, tid, group, src, dst, cols in msg[1]
            ]
            errors = [plane.wait_push(h, 300).error for h in handles]
            conn.send(("pushed", [e for e in errors if e]))
    except Exception:
        conn.send(("error", traceback.format_exc(limit=3)))
    finally:
        if plane is not None:
            plane.close()


def _pools(kit: Any, name: str, slots: int, *widths: int) -> list[Any]:
    """Zeroed ``[slots, width]`` uint8 page pools on the consumer's device."""
    import torch

    dev = kit.device(name, "consumer")
    if dev == "cpu":
        from .. import hostmem

        pools = [hostmem.empty((slots, w)) for w in widths]
    else:
        pools = [torch.empty(slots, w, dtype=torch.uint8, device=dev) for w in widths]
    for buf in pools:
        buf.fill_(0)
    return pools


def _rank(kit: Any, name: str, n: int, page_bytes: int, conn: Any) -> None:
    """A split's second consumer rank, a process of its own: its own plane and pool of
    S / 2-byte pages. Given the producer's caps ("source", caps) it answers ("ready",
    endpoint, caps); then per transfer ("arm", job): expects it, answers ("armed",),
    waits for it and answers ("landed", the DONE's perf_counter, error or None), its pages
    checked; until "stop"."""
    plane = None
    try:
        msg = conn.recv()
        if msg[0] != "source":
            return
        (others,) = _pools(kit, name, 2 * n, page_bytes // 2)
        plane = kit.make_plane(name)
        plane.register_regions([[others]])
        plane.add_source(msg[1])
        conn.send(("ready", plane.endpoint, plane.capabilities))
        while (msg := conn.recv())[0] == "arm":
            job = msg[1]
            plane.expect(job[0], 1, b"bench", [n], 300)
            conn.send(("armed",))
            st = plane.wait(job[0], 300)
            end, error = time.perf_counter(), None
            if not st.done:
                error = f"split transfer of the second rank failed: {st.error}"
            else:
                try:
                    _check("split", others, [job], page_bytes)
                except RuntimeError as exc:
                    error = f"second rank: {exc}"
            conn.send(("landed", end, error))
    except Exception:
        conn.send(("error", traceback.format_exc(limit=3)))
    finally:
        if plane is not None:
            plane.close()


def _answer(peer: Any, want: str) -> tuple[Any, ...]:
    """The second rank's next answer, which must be ``want``."""
    if not peer.poll(300):
        raise RuntimeError("the second consumer rank did not answer within 300 s")
    msg = peer.recv()
    if msg[0] != want:
        raise RuntimeError(f"second consumer rank: {msg[1] if len(msg) > 1 else msg[0]}")
    return msg  # type: ignore[no-any-return]


def _consumer(
    kit: Any, name: str, n: int, page_bytes: int, repeats: int, conn: Any, out: Any, peer: Any
) -> None:
    plane = None
    try:
        msg = conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"producer: {msg[1]}")
        peer.send(("source", msg[1]))
        slots = 2 * n
        pool, halves, others = _pools(
            kit, name, slots, page_bytes, page_bytes // 2, page_bytes // 2
        )
        run = page_bytes // BUFFERS
        plane = kit.make_plane(name)
        plane.register_regions(
            [
                [pool],
                [halves],
                [pool[:, b * run : b * run + run // 2] for b in range(BUFFERS)],
                [pool[:, b * run + run // 2 : (b + 1) * run] for b in range(BUFFERS)],
                [others],  # the second consumer rank's pool of a shared split
            ]
        )
        plane.add_source(msg[1])
        _, rank_ep, rank_caps = _answer(peer, "ready")
        rng = np.random.default_rng(1234)
        pushes = _columns(page_bytes)
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        tid = 0
        for rep in range(repeats + 1):
            for kind in KINDS:
                jobs, src0, dst = [], None, None
                for i, (group, cols) in enumerate(pushes[kind]):
                    src, d = draw(rng, slots, n)
                    dst = d if dst is None else dst  # merge: both parts land in one page
                    if kind.startswith("split"):  # both consumer ranks read the same pages
                        src = src if src0 is None else src0
                        src0 = src
                    tid += 1
                    job = (tid, group, src, dst, cols)
                    if kind == "split" and i:  # the second rank's own process
                        peer.send(("arm", job))
                        _answer(peer, "armed")
                        jobs.append((rank_ep, rank_caps, *job))
                        continue
                    plane.expect(tid, 1, b"bench", [0] * group + [n], 300)
                    jobs.append((plane.endpoint, plane.capabilities, *job))
                t = time.perf_counter()
                conn.send(("push", jobs))
                for posted in jobs:
                    if posted[0] != plane.endpoint:
                        continue  # the second rank's: it answers "landed"
                    st = plane.wait(posted[2], 300)
                    if not st.done:
                        raise RuntimeError(f"{kind} transfer failed: {st.error}")
                end = time.perf_counter()
                if kind == "split":
                    _, rank_end, error = _answer(peer, "landed")
                    if error:
                        raise RuntimeError(error)
                    end = max(end, rank_end)
                dt = end - t
                reply = conn.recv()
                if reply[0] != "pushed" or reply[1]:
                    raise RuntimeError(f"producer: {reply[1]}")
                mine = [j[2:] for j in jobs]
                if kind.startswith("split"):
                    _check(kind, halves, mine[:1], page_bytes)
                    if kind == "split_shared":
                        _check(kind, others, mine[1:], page_bytes)
                else:
                    _check(kind, pool, mine, page_bytes)
                if rep:
                    times[kind].append(dt)
        conn.send(("stop",))
        peer.send(("stop",))
        out.put((times, None, None))
    except Exception as exc:
        out.put((None, None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"))
        for c in (conn, peer):
            try:
                c.send(("stop",))
            except Exception:
                pass
    finally:
        if plane is not None:
            plane.close()


def measure(
    kit: Any, name: str, page_bytes: int, n: int, repeats: int, timeout_s: float
) -> dict[str, Any]:
    """One transport at one page size: every kind's GB/s and paired ratios. Three fresh
    spawned processes: the producer, the consumer (every kind's first consumer rank)
    and a split's second consumer rank, the consumer joined to the others by pipes."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    c, d = ctx.Pipe()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_producer, args=(kit, name, n, page_bytes, a), daemon=True),
        ctx.Process(
            target=_consumer, args=(kit, name, n, page_bytes, repeats, b, out, c), daemon=True
        ),
        ctx.Process(target=_rank, args=(kit, name, n, page_bytes, d), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        times, _, err = kit.result(out, procs[0], procs[1], timeout_s)
    finally:
        for p in reversed(procs):
            p.join(10)
            if p.is_alive():
                p.kill()
    transport, channel, _ = kit.spec[name]
    row: dict[str, Any] = {
        "transport": transport,
        "channel": channel,
        "page_bytes": page_bytes,
        "pages": n,
    }
    if times is None:
        return {**row, "error": err}
    landed = {"split1": n * page_bytes // 2}
    landed.update({kind: n * page_bytes for kind in KINDS if kind != "split1"})
    for kind in KINDS:
        row[f"{kind}_gbps"] = landed[kind] / median(times[kind]) / 1e9
    for kind in KINDS[1:]:
        row[f"{kind}_ratio"] = median(
            [
                (landed[kind] / t) / (landed["same"] / s)
                for t, s in zip(times[kind], times["same"], strict=True)
            ]
        )
    return row


def run(
    kit: Any,
    page_sizes: Sequence[int],
    total: int,
    transports: Sequence[str],
    repeats: int,
    timeout_s: float,
    log: Any,
) -> list[dict[str, Any]]:
    """Rows for every transport that can run here (``transfer.unavailable``) and size."""
    import torch

    rows = []
    for name in transports:
        if name in ("nixl-raw", "mooncake") or kit.unavailable(name, torch.cuda.is_available()):
            continue  # peers move whole pages with their own APIs; missing planes: skipped
        for pb in page_sizes:
            if pb % (2 * BUFFERS):
                continue
            r = measure(kit, name, pb, max(1, total // pb), repeats, timeout_s)
            rows.append(r)
            shown = (
                f"same {r['same_gbps']:.2f}, "
                + ", ".join(f"{k} {r[k + '_gbps']:.2f} ({r[k + '_ratio']:.2f}x)" for k in KINDS[1:])
                if "error" not in r
                else f"ERROR {r['error']}"
            )
            print(f"  tp {name:9s} {fmt_size(pb):>7s}: {shown} GB/s", file=log, flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'transport':10s} {'channel':7s} {'page':>7s} {'same':>7s} "
        + " ".join(f"{k[:7]:>7s} {'ratio':>6s}" for k in KINDS[1:])
        + "   (GB/s landed; ratio: paired median against same; split: two consumer"
        " processes, split_s(hared): one)"
    ]
    for r in rows:
        head = f"{r['transport']:10s} {r['channel']:7s} {fmt_size(r['page_bytes']):>7s}"
        if "error" in r:
            lines.append(f"{head}  error: {r['error']}")
            continue
        lines.append(
            f"{head} {r['same_gbps']:7.2f} "
            + " ".join(f"{r[k + '_gbps']:7.2f} {r[k + '_ratio']:6.2f}" for k in KINDS[1:])
        )
    return "\n".join(lines)
