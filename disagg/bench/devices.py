"""Per-role GPUs for ``disagg bench``: ``--producer-device`` / ``--consumer-device``.

The producer's role (its engine, its store) and the consumer's (its engine, the page pool
pushes land in) each name a device: ``cuda`` (this process's current GPU), ``cuda:N``, and
where the command runs engines on the host too, ``cpu``. Both default to the command's
old single device, so a run without them is the run it always was; the same command runs
unchanged with the roles on ``cuda:0`` and ``cuda:1`` of a two-GPU host.

``add_role_devices`` adds the two options (syntax checked by argparse); ``problem`` says
why a device cannot be used here (no CUDA, an index past the GPUs visible), as one line
naming the option and the fix. Between two GPUs, ``peer_copy_timer`` and
``peer_pages_timer`` time the ceilings of a transfer: one contiguous copy
(``Tensor.copy_`` across devices, ``cudaMemcpyPeer``) and the scattered-page kernel the
ipc plane runs (``page_copy.copy_indexed``: on the consumer's GPU, reading the
producer's over NVLink/PCIe). With both roles on one GPU they are that GPU's
device-to-device copy and kernel; ``label`` says which.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from typing import Any

from ..cliargs import cuda_problem

_CUDA = re.compile(r"^cuda(:\d+)?$")


def role_device(text: str) -> str:
    """argparse type: ``cuda`` or ``cuda:N`` (``cpu`` is allowed by ``cpu_role_device``)."""
    if not _CUDA.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a GPU; use cuda or cuda:N")
    return text


def cpu_role_device(text: str) -> str:
    """argparse type: ``cpu``, ``cuda`` or ``cuda:N``."""
    if text == "cpu":
        return text
    if not _CUDA.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda or cuda:N")
    return text


def add_role_devices(p: argparse.ArgumentParser, default: str | None, cpu: bool = False) -> None:
    """``--producer-device`` and ``--consumer-device``; ``default`` None: the command's
    ``--device`` (resolved by ``resolve``)."""
    kind = cpu_role_device if cpu else role_device
    where = "cpu, cuda or cuda:N" if cpu else "cuda or cuda:N"
    same = "" if default else " (default: --device's)"
    for role, what in (
        ("producer", "the producer's engine and store"),
        ("consumer", "the consumer's engine and page pool"),
    ):
        p.add_argument(
            f"--{role}-device",
            type=kind,
            default=default,
            metavar="DEVICE",
            help=f"{what}: {where}{same}",
        )


def resolve(args: argparse.Namespace, fallback: str) -> None:
    """Fill unset role devices with ``fallback`` (the command's ``--device``)."""
    for name in ("producer_device", "consumer_device"):
        if getattr(args, name) is None:
            setattr(args, name, fallback)


def problem(args: argparse.Namespace, cpu: bool = False) -> str | None:
    """One line naming the first role device that cannot be used here and the fix
    (``cpu``: the command runs engines on the host too)."""
    for opt in ("--producer-device", "--consumer-device"):
        dev = getattr(args, opt[2:].replace("-", "_"))
        why = cuda_problem(dev)
        if why is not None:
            fix = f"use {opt} cpu" if cpu else "run it on a host with a GPU"
            return f"argument {opt}: {dev!r}: {why.replace('use --device cpu', fix)}"
    return None


def index(device: str) -> int:
    """The GPU ordinal of ``cuda`` / ``cuda:N`` (``cuda``: this thread's current GPU)."""
    if device.startswith("cuda:"):
        return int(device[5:])
    import torch

    return int(torch.cuda.current_device())


def explicit(device: str) -> str:
    """``cuda:N`` for ``cuda`` / ``cuda:N`` (``cuda``: this thread's current GPU now), so
    child processes, which start on cuda:0, name the same GPU."""
    return f"cuda:{index(device)}"


def same_gpu(producer: str, consumer: str) -> bool:
    return index(producer) == index(consumer)


def label(producer: str, consumer: str) -> str:
    """How a report names the pair: ``cuda:0 -> cuda:1`` or ``cuda:0 (same device)``."""
    p, c = index(producer), index(consumer)
    return f"cuda:{p} (same device)" if p == c else f"cuda:{p} -> cuda:{c}"


def peer_problem(producer: str, consumer: str) -> str | None:
    """Why a kernel on the consumer's GPU cannot read the producer's (None: it can, or
    they are one GPU); enables peer access where it can."""
    from ..transport import cuda_driver

    p, c = index(producer), index(consumer)
    return None if p == c else cuda_driver.enable_peer_access(c, p)


def _synced(devices: tuple[int, ...], fn: Callable[[], Any]) -> float:
    """Seconds of one ``fn``, every GPU of ``devices`` synchronised around it."""
    import torch

    for d in devices:
        torch.cuda.synchronize(d)
    t = time.perf_counter()
    fn()
    for d in devices:
        torch.cuda.synchronize(d)
    return time.perf_counter() - t


def peer_copy_timer(producer: str, consumer: str, nbytes: int) -> Callable[[], float]:
    """One timed contiguous copy of ``nbytes`` from the producer's GPU to the
    consumer's per call (its seconds): ``Tensor.copy_`` across devices, which torch runs
    as a peer copy where the GPUs allow it (a device-to-device copy on one GPU)."""
    import torch

    p, c = index(producer), index(consumer)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=f"cuda:{p}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{c}")
    return lambda: _synced((p, c), lambda: dst.copy_(src))


def peer_pages_timer(
    producer: str, consumer: str, page_bytes: int, n: int, seed: int = 0
) -> Callable[[], float]:
    """One timed scattered-page copy per call (its seconds): ``n`` pages drawn at random
    from a store of ``2n`` on the producer's GPU into random slots of a pool of ``2n`` on
    the consumer's, by the ipc plane's kernel (``page_copy.copy_indexed``), launched on
    the consumer's GPU. Checks the bytes once before returning the timer."""
    import torch

    from ..transport.page_copy import copy_indexed

    p, c = index(producer), index(consumer)
    peer_problem(producer, consumer)  # the kernel path where the GPUs allow it
    gen = torch.Generator().manual_seed(seed)
    store = torch.randint(0, 255, (2 * n, page_bytes), dtype=torch.uint8, device=f"cuda:{p}")
    pool = torch.zeros((2 * n, page_bytes), dtype=torch.uint8, device=f"cuda:{c}")
    rows = torch.randperm(2 * n, generator=gen)[:n].to(f"cuda:{c}")
    slots = torch.randperm(2 * n, generator=gen)[:n].to(f"cuda:{c}")

    def once() -> None:
        with torch.cuda.device(c):
            copy_indexed(pool, slots, store, rows)

    _synced((p, c), once)
    want = store[rows.to(store.device)].to(pool.device)
    if not torch.equal(pool[slots], want):
        raise RuntimeError(f"scattered-page copy {label(producer, consumer)} corrupted pages")
    return lambda: _synced((p, c), once)
