"""``disagg bench transfer``: N scattered pages of S bytes from a producer process's store
into a consumer process's page pool, through the real data planes, against ceilings
measured in the same run.

Per transport and page size: the producer holds a store of 2N pages (row k starts with
the 8-byte index k), the consumer a pool of 2N slots; each repetition draws N random
source rows and N random destination slots, ``expect``s the transfer, tells the producer
to push (a pipe stands in for the control Push), and times go -> receiver DONE. The
producer hands the plane exactly what ``ProducerService`` hands it
(``dataplane.push_source``): the rows left in the store for a plane that reads them there
(``accepts_store_rows``), else their bytes gathered from the store, inside the timed
window, as in production. Pages are verified afterwards (each landed slot starts with
its source row's index). Host store and pool come from ``hostmem.empty`` (huge pages
where the kernel allows, like the producer's store); the memcpy ceiling is measured on
the same kind of buffers (``memcpy_plain``, on ordinary ones, is printed for reference).
Peers (NIXL, Mooncake) move the same pages with their own APIs (peers.py), from the same
random source rows; a peer that cannot run keeps its row, with the error.

Ceilings: memcpy for shm, raw TCP for tcp, AF_UNIX for ipc, a device-to-device copy for
``ucx-cuda`` and ``ipc-cuda`` (store on ``--producer-device``, pool on
``--consumer-device``, both ``cuda`` by default: two processes on one GPU; on two GPUs
the ceiling is the ipc plane's scattered-page kernel between them, ``peer_pages``, see
devices.py; without a CUDA device their rows say so instead of a figure). Each row's
ceiling is PAIRED with its pushes: in the row's own producer / consumer processes, on
the same bytes, the consumer times one ceiling run right before each push (ceiling,
push, ceiling, push ..., after one warm-up of each): the producer process streams the N pages' bytes over a raw
loopback TCP (AF_UNIX for ipc) socket set up once per row into a ``hostmem`` buffer of
the consumer (``ceilings.serve_stream`` / ``stream_timer``); for shm the consumer times a
memcpy of the same bytes between ``hostmem`` buffers; for d2d a device-to-device copy.
Why: this shared 2-core box drifts between minutes (raw TCP 1.5-4.5 GB/s), so a ceiling
measured in other processes before the row gave the same code ratios of 0.43-2.5; paired,
both sides see the same conditions. A row's ``ceiling_gbps`` is nbytes / median ceiling
time, ``gbps`` nbytes / median push time, ``ratio`` their quotient, and
``ratio_paired_median`` the median of the per-repetition push / ceiling ratios (it also
cancels drift within the row). Peers' rows are paired the same way (``ceiling_paired``
says so on every row). The run-level ``ceilings_gbps`` are the ones measured at the start.
``ipc-shm``/``ipc-cuda`` are the same-host plane: the consumer copies from the producer's
store (/dev/shm or CUDA IPC), so the medium is one copy.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..cliargs import Parser, positive_float, positive_int, size, size_list
from . import ceilings, devices, transfer_tp
from .peers import draw
from .units import fmt_size, median

ALL_TRANSPORTS = (
    "tcp-tcp",
    "tcp-unix",
    "ucx-tcp",
    "ucx-shm",
    "ucx-cuda",
    "ipc-shm",
    "ipc-cuda",
    "nixl",
    "nixl-tcp",
    "nixl-raw",
    "mooncake",
)
# transport -> (reported transport, channel, medium whose ceiling applies)
SPEC = {
    "tcp-tcp": ("tcp", "tcp", "tcp"),
    "tcp-unix": ("tcp", "unix", "ipc"),  # an AF_UNIX socket (ipc:// endpoint)
    "ucx-tcp": ("ucx", "tcp", "tcp"),
    "ucx-shm": ("ucx", "shm", "shm"),
    "ucx-cuda": ("ucx", "cuda", "d2d"),  # device memory both sides: UCX cuda_ipc
    "ipc-shm": ("ipc", "shm", "shm"),  # the consumer copies out of the store's /dev/shm
    "ipc-cuda": ("ipc", "cuda", "d2d"),  # ... out of the store's CUDA IPC mapping
    # the nixl plane, UCX picking its transports (cma locally) or TCP only; its ceiling is
    # raw NIXL reading the same number of pages through the same descriptors (peers.py)
    "nixl": ("nixl", "auto", "nixl"),
    "nixl-tcp": ("nixl", "tcp", "nixl-tcp"),
    "nixl-raw": ("nixl-raw", "auto", "shm"),  # raw NIXL itself, against memcpy
    "mooncake": ("mooncake", "tcp", "tcp"),
}
# the medium's paired ceiling, by name in the report
CEILING_NAMES = {"shm": "memcpy", "tcp": "raw_tcp", "ipc": "raw_unix", "d2d": "d2d"}
CEILING_NAMES.update({"nixl": "raw_nixl", "nixl-tcp": "raw_nixl_tcp"})
AWAIT_SLICE_S = 0.05  # the longest a failed producer goes unnoticed by _await
# a pause between a ceiling's run and the timed transfer, as before the ceiling: right
# after a raw NIXL read the next read ran 0.75-0.85 of its pace (design/nixl-plane.md)
SETTLE_S = 0.01
NIXL_TRANSPORTS = {"nixl": None, "nixl-tcp": "tcp,self"}  # UCX's transport list per medium


def unavailable(name: str, cuda: bool) -> tuple[str, str] | None:
    """(why ``name`` cannot run on this machine, what to install), or None when it can.
    Checked without importing the peers' native libraries (a crash there would take the
    benchmark down; their rows run in child processes)."""
    import ctypes.util
    import importlib.util

    def missing(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except (ImportError, ValueError):
            return True

    if SPEC[name][2] == "d2d" and not cuda:
        return "no CUDA device", "a machine with an NVIDIA GPU and a CUDA build of torch"
    if name.startswith("ucx-") and missing("ucxx"):
        return "the Python package ucxx is not installed", 'pip install -e ".[ucx]"'
    if name.startswith("nixl") and all(map(missing, ("nixl_cu12", "nixl_cu13", "nixl"))):
        return "the Python package nixl is not installed", 'pip install -e ".[nixl]"'
    if name == "mooncake":
        if missing("mooncake"):
            return (
                "the Python package mooncake is not installed",
                "pip install mooncake-transfer-engine-non-cuda",
            )
        if ctypes.util.find_library("ibverbs") is None:
            return (
                "the system library libibverbs.so.1 is missing (Mooncake loads it even for TCP)",
                "apt-get install libibverbs1",
            )
    return None


def _make_plane(name: str) -> Any:
    if name == "tcp-tcp":
        from ..transport.tcp import TcpDataPlane

        return TcpDataPlane("tcp://127.0.0.1:0")
    if name == "tcp-unix":
        from ..transport.tcp import TcpDataPlane

        path = os.path.join(tempfile.gettempdir(), f"disagg-bench-{os.getpid()}.ipc")
        return TcpDataPlane(f"ipc://{path}")
    if name.startswith("ipc-"):
        from ..transport.ipc import IpcDataPlane

        return IpcDataPlane()
    if name.startswith("nixl"):
        from ..transport.nixl.plane import NixlDataPlane

        return NixlDataPlane(transports=NIXL_TRANSPORTS[SPEC[name][2]])
    from ..transport.ucx.plane import UcxDataPlane

    if name == "ucx-cuda":  # worker-address endpoints: UCX picks cuda_ipc on one node
        return UcxDataPlane(channel="shm", cuda=True)
    return UcxDataPlane(channel=name.split("-", 1)[1])


@dataclass(frozen=True)
class Roles:
    """Where a ``-cuda`` row's store (producer) and pool (consumer) live."""

    producer: str = "cuda"
    consumer: str = "cuda"

    def of(self, name: str, role: str) -> str:
        """The device of ``role``'s memory in row ``name`` (host memory unless ``-cuda``)."""
        if not name.endswith("-cuda"):
            return "cpu"
        import torch

        dev = self.producer if role == "producer" else self.consumer
        torch.cuda.set_device(devices.index(dev))  # the process's GPU: UCX, Triton, streams
        return dev

    def ceiling(self, medium: str) -> str:
        """The report's name of ``medium``'s ceiling (two GPUs: the peer page kernel)."""
        if medium == "d2d" and not devices.same_gpu(self.producer, self.consumer):
            return "peer_pages"
        return CEILING_NAMES[medium]


def _store(n: int, page_bytes: int) -> np.ndarray:
    from .. import hostmem  # like the producer's BlockStore: huge pages, 2 MiB-aligned

    store = hostmem.empty((n, page_bytes)).numpy()
    store.fill(7)  # prefault
    store[:, :8] = np.arange(n, dtype=np.int64).view(np.uint8).reshape(n, 8)
    return store


def _producer(name: str, n: int, page_bytes: int, conn: Any, roles: Roles = Roles()) -> None:
    """Serve push requests ("push", endpoint, caps, tid, src rows, dst slots) until told to stop;
    for a tcp / ipc row, first the raw stream of the row's paired ceiling (``_serve_raw``)."""
    import torch

    from ..transport.dataplane import push_source

    plane = None
    stop_raw = None
    try:
        store = _store(2 * n, page_bytes)
        medium = SPEC[name][2]
        if medium in ("tcp", "ipc"):  # the store's first N rows: the bytes of one push
            stop_raw = _serve_raw(medium, store.reshape(-1)[: n * page_bytes], conn)
        if medium in NIXL_TRANSPORTS:  # the ceiling reads the store through its own agent
            from . import peers

            raw_source = peers.nixl_source(store, NIXL_TRANSPORTS[medium])
            conn.send(("raw", (raw_source.get_agent_metadata(), store.ctypes.data)))
        if name in ("nixl-raw", "mooncake"):
            from . import peers

            peers.producer(name, store, conn)
            return
        # the consumer's first message on the pipe: the plane is up
        plane = _make_plane(name)
        rows = torch.from_numpy(store).to(roles.of(name, "producer"))
        register = getattr(plane, "register_source", None)
        if register is not None:  # the ipc plane shares the store (shm / CUDA IPC)
            rows = register(rows)
        cols = ((0, page_bytes),)
        conn.send(("ready", plane.source_caps))  # what the HelloOk carries
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, endpoint, caps, tid, src, dst = msg
            pages = [(0, *push_source(plane, rows, src, cols, dst))]
            h = plane.post_push(endpoint, tid, 1, b"bench", pages, deadline_s=300, caps=caps)
            st = plane.wait_push(h, 300)
            conn.send(("pushed", st.error))
    except Exception:
        conn.send(("error", traceback.format_exc(limit=3)))
    finally:
        if plane is not None:
            plane.close()
        if stop_raw is not None:
            stop_raw()


def _serve_raw(medium: str, src: np.ndarray, conn: Any) -> Any:
    """Listen for the consumer's raw stream (loopback TCP, or AF_UNIX for ipc), tell it
    where (("raw", address), the first message on the pipe) and serve ``src`` on it from
    a thread (``ceilings.serve_stream``: it blocks in ``recv`` between the consumer's go
    bytes, so it takes no CPU while a push runs). Returns the listener's cleanup."""
    srv, addr, cleanup = ceilings.listener("tcp" if medium == "tcp" else "unix")

    def serve() -> None:
        try:
            sock, _ = srv.accept()
            sock.settimeout(None)
            ceilings.serve_stream(sock, src)
        except OSError:  # the consumer failed or never connected: its row says why
            pass

    threading.Thread(target=serve, name="bench-raw-sender", daemon=True).start()
    conn.send(("raw", addr))
    return cleanup


def _consumer(
    name: str, n: int, page_bytes: int, repeats: int, conn: Any, out: Any, roles: Roles = Roles()
) -> None:
    """Time ``repeats`` transfers (after one warm-up), each right after one run of the row's
    ceiling on the same bytes (``_ceiling_timer``); put (push seconds, ceiling seconds,
    error) on out."""
    import torch

    plane = None
    close_ceiling = None
    try:
        msg = conn.recv()
        raw_addr = None
        if msg[0] == "raw":  # tcp / ipc rows: the producer's raw stream comes first
            raw_addr = msg[1]
            msg = conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"producer: {msg[1]}")
        slots = 2 * n  # the store has 2N rows too: sources are drawn from it at random
        where = roles.of(name, "consumer")
        if where == "cpu":  # huge pages where the kernel allows (hostmem.py)
            from .. import hostmem

            pool = hostmem.empty((slots, page_bytes))
        else:
            pool = torch.empty(slots, page_bytes, dtype=torch.uint8, device=where)
        pool.fill_(0)  # prefault
        if roles.ceiling(SPEC[name][2]) == "peer_pages":  # two GPUs: the kernel between them
            ceiling = devices.peer_pages_timer(roles.producer, roles.consumer, page_bytes, n)
            close_ceiling = None
        else:
            ceiling, close_ceiling = _ceiling_timer(SPEC[name][2], n * page_bytes, pool, raw_addr)
        rng = np.random.default_rng(1234)
        if name in ("nixl-raw", "mooncake"):
            from . import peers

            times, ctimes = peers.consumer(name, pool.numpy(), n, repeats, conn, rng, msg, ceiling)
        else:
            plane = _make_plane(name)
            plane.register_regions([[pool]])
            plane.add_source(msg[1])  # the producer's handshake
            times, ctimes = [], []
            for rep in range(repeats + 1):
                src, dst = draw(rng, slots, n)
                tid = rep + 1
                c = ceiling()  # paired: the same conditions as the push right after it
                time.sleep(SETTLE_S)
                t = time.perf_counter()
                plane.expect(tid, 1, b"bench", [n], 300)  # then the Push, as a consumer does
                conn.send(("push", plane.endpoint, plane.capabilities, tid, src, dst))
                st, reply = _await(plane, tid, conn, 300)
                dt = time.perf_counter() - t
                reply = reply or conn.recv()
                if not st.done:
                    raise RuntimeError(f"transfer failed: {st.error}; producer: {reply[1]}")
                if pool.device.type == "cpu":
                    # numpy, not a torch index: torch's intra-op (OpenMP) threads spin for
                    # a while after a parallel op, on the cores the next timed transfer's
                    # reader threads need (3 A/B pairs, UCX shm: 256 KiB 0.72-0.78 -> 0.75-
                    # 1.04 of memcpy; 64 KiB within the noise, 0.56-0.71 -> 0.55-0.65)
                    got = pool.numpy()[np.asarray(dst), :8]
                else:
                    got = pool[torch.as_tensor(dst, device=pool.device), :8].cpu().numpy()
                got = got.copy().view(np.int64).reshape(-1)
                if not np.array_equal(got, src):
                    raise RuntimeError("pages landed in the wrong slots or corrupted")
                if rep:
                    times.append(dt)
                    ctimes.append(c)
            conn.send(("stop",))
        out.put((times, ctimes, None))
    except Exception as exc:
        err = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        out.put((None, None, err))
        try:
            conn.send(("stop",))
        except Exception:
            pass
    finally:
        if plane is not None:
            plane.close()
        if close_ceiling is not None:
            close_ceiling()


def _ceiling_timer(
    medium: str, nbytes: int, pool: Any, raw_addr: Any
) -> tuple[Callable[[], float], Callable[[], None]]:
    """(one timed run of the medium's ceiling on ``nbytes``, its cleanup), in the consumer:
    a memcpy between two ``hostmem`` buffers (shm); the producer's raw stream received
    into a ``hostmem`` buffer, like the pool (tcp / ipc); a device-to-device copy of the
    pool's first ``nbytes`` (d2d); raw NIXL reading as many random rows of the producer's
    store into random slots of the pool, the descriptors the plane posts (nixl)."""
    if medium in NIXL_TRANSPORTS:
        from . import peers

        meta, base = raw_addr
        rows = pool.shape[0]
        raw = peers.RawNixl(pool.numpy(), meta, base, rows, NIXL_TRANSPORTS[medium])
        rng = np.random.default_rng(99)
        n = nbytes // pool.shape[1]
        return (lambda: raw.read(*draw(rng, rows, n))), lambda: None
    if medium == "shm":
        return ceilings.memcpy_timer(nbytes), lambda: None
    if medium == "d2d":
        return ceilings.d2d_timer(pool.view(-1)[:nbytes]), lambda: None
    from .. import hostmem

    if raw_addr is None:
        raise RuntimeError("the producer sent no raw stream address")
    sock = ceilings.connect(raw_addr)
    dst = hostmem.empty(nbytes).numpy()
    dst.fill(0)  # prefault

    def close() -> None:
        try:
            sock.sendall(b"q")
        except OSError:
            pass
        sock.close()

    return ceilings.stream_timer(sock, dst), close


def _await(plane: Any, tid: int, conn: Any, timeout_s: float) -> tuple[Any, Any]:
    """The transfer's final status, and the producer's reply if it came first; a producer
    that failed (its "error" reply) raises at once instead of leaving the transfer to time
    out. Waits in the plane's ``wait`` (``BookedReceiver.wait``: woken the moment the plane
    ends the transfer), in slices of ``AWAIT_SLICE_S`` between which the pipe is read. A
    sleep-poll here would be a thread waking every 0.2 ms beside the plane's own for the
    whole transfer, which the paired ceiling runs without: on two cores that alone moved
    the nixl row from about 0.9 of raw NIXL to 0.7-0.8 (docs/design/nixl-plane.md)."""
    end = time.monotonic() + timeout_s
    reply = None
    while True:
        st = plane.wait(tid, max(0.0, min(AWAIT_SLICE_S, end - time.monotonic())))
        if st.final or time.monotonic() >= end:
            return st, reply
        if reply is None and conn.poll():
            reply = conn.recv()
            if reply[0] == "error":
                raise RuntimeError(f"producer: {reply[1]}")


@dataclass
class Row:
    """One transport at one page size: per-repetition push and paired ceiling seconds
    (``push_s[i]`` timed right after ``ceiling_s[i]``), or the error."""

    nbytes: int
    push_s: list[float] = field(default_factory=list)
    ceiling_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def gbps(self) -> float | None:
        return self.nbytes / median(self.push_s) / 1e9 if self.push_s else None

    @property
    def ceiling_gbps(self) -> float | None:
        return self.nbytes / median(self.ceiling_s) / 1e9 if self.ceiling_s else None

    @property
    def ratio_paired_median(self) -> float | None:
        """Median over repetitions of (push GB/s / its paired ceiling's GB/s)."""
        if not self.push_s or len(self.push_s) != len(self.ceiling_s):
            return None
        return median([c / p for p, c in zip(self.push_s, self.ceiling_s, strict=True)])


def measure(
    name: str, page_bytes: int, n: int, repeats: int, timeout_s: float, roles: Roles = Roles()
) -> Row:
    """``repeats`` pushes of one transport at one page size, each paired with a run of its
    ceiling, in one fresh producer / consumer process pair (``-cuda`` rows: on ``roles``'
    GPUs)."""
    times, ctimes, err = _pair(
        _producer,
        (name, n, page_bytes),
        _consumer,
        (name, n, page_bytes, repeats),
        timeout_s,
        (roles,),
    )
    if times is None:
        return Row(n * page_bytes, error=err)
    return Row(n * page_bytes, times, ctimes)


def _pair(
    producer: Any,
    pargs: tuple[Any, ...],
    consumer: Any,
    cargs: tuple[Any, ...],
    timeout_s: float,
    tail: tuple[Any, ...] = (),
) -> tuple[Any, Any, str | None]:
    """Run ``producer(*pargs, conn, *tail)`` and ``consumer(*cargs, conn, out, *tail)`` as
    one fresh spawned process pair joined by a pipe; the consumer's result (``_result``)."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    prod = ctx.Process(target=producer, args=(*pargs, a, *tail), daemon=True)
    cons = ctx.Process(target=consumer, args=(*cargs, b, out, *tail), daemon=True)
    prod.start()
    cons.start()
    try:
        return _result(out, prod, cons, timeout_s)
    finally:
        for p in (cons, prod):
            p.join(10)
            if p.is_alive():
                p.kill()


def _result(out: Any, prod: Any, cons: Any, timeout_s: float) -> tuple[Any, Any, str | None]:
    """The consumer's (times, ceiling times, error), or an error once ``timeout_s`` has passed or either
    process died without answering (a crash in a peer's native library, say)."""
    deadline = time.monotonic() + timeout_s
    dead_since = None
    while True:
        try:
            return out.get(timeout=0.5)  # type: ignore[no-any-return]
        except queue.Empty:
            pass
        now = time.monotonic()
        if now >= deadline:
            return None, None, f"timed out after {timeout_s:.0f} s"
        dead = [
            f"{who} exited with code {p.exitcode}"
            for who, p in (("producer", prod), ("consumer", cons))
            if p.exitcode is not None and p.exitcode != 0
        ] + (["consumer exited without a result"] if cons.exitcode == 0 else [])
        if dead:
            dead_since = dead_since or now
            if now - dead_since > 3:  # a last result may still be in flight
                return None, None, "; ".join(dead)


def run(
    page_sizes: Sequence[int],
    total: int,
    transports: Sequence[str],
    repeats: int,
    timeout_s: float = 300,
    log: Any = None,
    roles: Roles = Roles(),
) -> dict[str, Any]:
    log = log or sys.stderr
    ceil = {
        "shm": ceilings.memcpy_gbps(total, repeats),  # on hostmem buffers, like the pool
        "tcp": ceilings.socket_gbps("tcp", total, repeats),
        "ipc": ceilings.socket_gbps("unix", total, repeats),
    }
    plain = ceilings.memcpy_gbps(total, repeats, plain=True)  # for reference only
    gpu = ceilings.gpu_ceilings(total, repeats)
    ceil_of: dict[str, float | None] = {**ceil, "d2d": gpu.get("d2d")}
    print(
        f"ceilings ({fmt_size(total)}): "
        + ", ".join(f"{k} {v:.2f} GB/s" for k, v in {**ceil, "memcpy_plain": plain, **gpu}.items()),
        file=log,
    )
    rows = []
    skipped = []
    for name in list(transports):
        why = unavailable(name, ceil_of["d2d"] is not None)
        if why is not None:
            skipped.append({"transport": name, "reason": why[0], "fix": why[1]})
    if skipped:
        print(f"not run here: {', '.join(s['transport'] for s in skipped)}", file=log)
    for name in transports:
        if any(s["transport"] == name for s in skipped):
            continue
        transport, channel, medium = SPEC[name]
        for pb in page_sizes:
            n = max(1, total // pb)
            r = measure(name, pb, n, repeats, timeout_s, roles)
            gbps, ceiling, err = r.gbps, r.ceiling_gbps, r.error
            row = {
                "transport": transport,
                "channel": channel,
                "page_bytes": pb,
                "pages": n,
                "gbps": gbps,
                "ceiling_gbps": ceiling,
                "ceiling": roles.ceiling(medium) if gpu else CEILING_NAMES[medium],
                "ceiling_paired": True,  # timed between the row's pushes (module docstring)
                "ratio": (gbps / ceiling) if gbps is not None and ceiling else None,
                "ratio_paired_median": r.ratio_paired_median,
            }
            if err:
                row["error"] = err
            rows.append(row)
            shown = (
                f"{gbps:.2f} GB/s ({row['ratio']:.2f}x of {row['ceiling']} {ceiling:.2f}, "
                f"paired median {row['ratio_paired_median']:.2f}x)"
                if gbps is not None and ceiling
                else f"ERROR {err}"
            )
            print(f"  {name:9s} {fmt_size(pb):>7s} x {n:6d}: {shown}", file=log, flush=True)
    return {
        "bench": "transfer",
        "total_bytes": total,
        "repeats": repeats,
        "ceilings_gbps": {
            "memcpy": ceil["shm"],
            "memcpy_plain": plain,
            "raw_tcp": ceil["tcp"],
            "raw_unix": ceil["ipc"],
            **gpu,
        },
        "cpus": os.cpu_count(),
        "devices": devices.label(roles.producer, roles.consumer) if gpu else None,
        "results": rows,
        "skipped": skipped,
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{'transport':10s} {'channel':7s} {'page':>7s} {'GB/s':>7s} {'ceiling':>9s} {'GB/s':>6s} "
        f"{'ratio':>6s} {'paired':>6s}",
    ]
    for r in report["results"]:
        g = f"{r['gbps']:.2f}" if r["gbps"] is not None else "-"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        rpm = r.get("ratio_paired_median")
        paired = f"{rpm:.2f}" if rpm is not None else "-"
        cg = f"{r['ceiling_gbps']:6.2f}" if r["ceiling_gbps"] is not None else f"{'-':>6s}"
        line = (
            f"{r['transport']:10s} {r['channel']:7s} {fmt_size(r['page_bytes']):>7s} {g:>7s} "
            f"{r['ceiling']:>9s} {cg} {ratio:>6s} {paired:>6s}"
        )
        if r.get("error"):
            line += f"  error: {r['error']}"
        lines.append(line)
    if report.get("skipped"):
        lines.append("not run on this machine:")
        for s in report["skipped"]:
            lines.append(f"  {s['transport']:9s} {s['reason']}; fix: {s['fix']}")
    return "\n".join(lines)


def tp_kit(roles: Roles) -> SimpleNamespace:
    """What ``transfer_tp``'s rows run on (picklable: handed to its child processes)."""
    return SimpleNamespace(
        make_plane=_make_plane,
        device=roles.of,
        store=_store,
        result=_result,
        unavailable=unavailable,
        spec=SPEC,
    )


# Former names, refused with the one to use.
RENAMED = {"zmq-tcp": "tcp-tcp", "zmq-ipc": "tcp-unix"}


def transport_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    for t in names:
        if t in RENAMED:
            raise argparse.ArgumentTypeError(f"{t!r} was renamed; use {RENAMED[t]!r}")
    unknown = [t for t in names if t not in SPEC]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown transport(s) {','.join(unknown) or '(none)'}; "
            f"choose from {','.join(ALL_TRANSPORTS)}"
        )
    return names


def main(argv: Sequence[str]) -> int:
    ap = Parser(prog="disagg bench transfer", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--page-sizes",
        type=size_list,
        default="16KiB,64KiB,256KiB,1MiB,4MiB",
        help="page sizes, comma-separated, binary suffixes (KiB, MiB, GiB) or bytes",
    )
    ap.add_argument("--total", type=size, default="256MiB", help="bytes per transfer (full: 1GiB)")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument(
        "--transports",
        type=transport_list,
        default=",".join(ALL_TRANSPORTS),
        help=f"comma-separated, any of: {', '.join(ALL_TRANSPORTS)} (those that cannot run "
        "here are listed apart, with what to install)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="CI smoke run: 4MiB of 256KiB pages, 1 repeat"
    )
    ap.add_argument(
        "--timeout", type=positive_float, default=120, help="seconds per transport and size"
    )
    devices.add_role_devices(ap, "cuda")  # the -cuda rows' store and pool
    ap.add_argument(
        "--tp",
        action="store_true",
        help="also TP-split and TP-merge rows beside each same-TP one (transfer_tp.py)",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object on the last stdout line")
    ap.add_argument("--plot", help="write a PNG of GB/s against page size")
    a = ap.parse_args(list(argv))
    roles = Roles(a.producer_device, a.consumer_device)
    if any(t.endswith("-cuda") for t in a.transports) and roles != Roles():
        why = devices.problem(a)
        if why is not None:
            ap.error(why)
        roles = Roles(devices.explicit(roles.producer), devices.explicit(roles.consumer))
    if a.quick:  # every transport and peer once, at one size: well under a minute
        a.total, a.repeats = 4 << 20, 1
        if a.page_sizes == size_list(ap.get_default("page_sizes")):
            a.page_sizes = [256 << 10]
        a.timeout = min(a.timeout, 30)
    report = run(a.page_sizes, a.total, a.transports, a.repeats, a.timeout, roles=roles)
    if a.tp:
        report["tp"] = transfer_tp.run(
            tp_kit(roles), a.page_sizes, a.total, a.transports, a.repeats, a.timeout, sys.stderr
        )
    print(table(report))
    if a.tp:
        print(transfer_tp.table(report["tp"]))
    if a.plot:
        from .plot import plot_transfer

        err = plot_transfer(report, a.plot)
        print(err or f"plot written to {a.plot}", file=sys.stderr)
    if a.json:
        print(json.dumps(report))
    return 0
