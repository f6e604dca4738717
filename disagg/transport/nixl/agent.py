"""A NIXL agent as the nixl plane uses it: created with its backend, memory registered
once per span, metadata, and the calls whose failures NIXL reports as exceptions.

- ``nixl_api()``: NIXL's Python API from the ``nixl-cu12`` wheel (module ``nixl_cu12``)
  or a ``nixl`` install; ImportError naming the extra otherwise.
- ``open_agent``: one agent with one backend (``UCX`` by default) and NIXL's progress
  thread, which makes UCX progress (a peer's reads of our memory over tcp, our reads'
  completions) without this process's GIL. NIXL's Python API starts that thread with a
  poll timeout of 0, which spins a core even when idle (3.0 CPU-s per 3 s measured here);
  ``open_agent`` gives it ``PROGRESS_DELAY_US``: the thread then sleeps on the UCX
  worker's event fd, waking at least that often (NIXL's guard against a missed wake-up).
  Measured on the 2-core box: a 256 MiB read 5.3 GB/s against 2.9 with the spinning
  thread; two idle planes 0.09 CPU-s per 3 s at 0.5 ms (a 2 ms delay left some read
  plans 85-110 ms late).
- ``Registry``: registers each distinct span of memory once (overlapping views such as a
  layer's column slice of its group's region share their region's registration).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

PROGRESS_DELAY_US = 500
_make_lock = threading.Lock()


def nixl_api() -> Any:
    """NIXL's ``_api`` module (``nixl_agent``, ``nixl_agent_config``): from the
    ``nixl-cu12`` wheel, the ``nixl-cu13`` one, or a ``nixl`` install."""
    import importlib

    for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(
        "transport: 'nixl' needs NIXL; install it with `pip install -e \".[nixl]\"` (the "
        "nixl-cu12 wheel; nixl-cu13 for CUDA 13) or choose another transport"
    )


def available() -> bool:
    try:
        nixl_api()
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _progress_delay(api: Any, delay_us: int) -> Iterator[None]:
    """While an agent is made: its config's progress-thread delay set to ``delay_us``
    (the Python API has no argument for it; see the module docstring)."""
    make = api.nixlBind.nixlAgent

    def agent(name: str, cfg: Any) -> Any:
        cfg.pthrDelay = delay_us
        return make(name, cfg)

    with _make_lock:
        api.nixlBind.nixlAgent = agent
        try:
            yield
        finally:
            api.nixlBind.nixlAgent = make


def open_agent(
    name: str,
    backend: str = "UCX",
    devices: str | None = None,
    transports: str | None = None,
    telemetry: bool = False,
    error_handling: str = "peer",
) -> Any:
    """A ``nixl_agent`` named ``name`` with ``backend`` (its devices: ``devices``, a
    comma-separated list such as ``mlx5_0:1``; ``transports``: UCX's transport list,
    e.g. ``tcp,self``, for this agent only; ``error_handling``: UCX's peer error handling,
    ``peer`` (a dead peer fails the read; UCX then leaves out shared memory and cuda_ipc)
    or ``none``). RuntimeError naming the fix when the backend is not in this NIXL build
    or fails to start."""
    api = nixl_api()
    cfg = api.nixl_agent_config(
        enable_prog_thread=True,
        backends=[],
        capture_telemetry=telemetry,
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    with _progress_delay(api, PROGRESS_DELAY_US):
        agent = api.nixl_agent(name, cfg)
    plugins = agent.get_plugin_list()
    if backend not in plugins:
        raise RuntimeError(
            f"nixl_backend {backend!r} is not in this NIXL build (it has "
            f"{', '.join(sorted(plugins))}): set nixl_backend to one of them"
        )
    params: dict[str, str] = {}
    if devices:
        params["ucx_devices" if backend == "UCX" else "device_list"] = devices
    if transports:
        if backend != "UCX":
            raise ValueError(f"transports apply to the UCX backend, not {backend!r}")
        params["engine_config"] = f"TLS={transports}"
    if error_handling not in ("peer", "none"):
        raise ValueError(f"nixl_error_handling: {error_handling!r}; use peer or none")
    if backend == "UCX":
        params["ucx_error_handling_mode"] = error_handling
        if error_handling == "none":
            # cuda_ipc serves the consumer's READs (GETs) only with this switch; read by
            # UCX when the backend makes its context (docs/design/nixl-plane.md)
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
    elif error_handling != "peer":
        raise ValueError(f"nixl_error_handling applies to the UCX backend, not {backend!r}")
    try:
        agent.create_backend(backend, params)
    except Exception as exc:
        raise RuntimeError(
            f"NIXL backend {backend} failed to start ({type(exc).__name__}: {exc}): its "
            "plugin's libraries are missing here, or nixl_devices names a device it cannot "
            "open (UCX: as `ucx_info -d` lists them, e.g. mlx5_0:1); set nixl_backend: UCX "
            "or fix nixl_devices"
        ) from None
    return agent


def mem_of(t: torch.Tensor) -> tuple[str, int]:
    """(NIXL memory kind, device id) of a tensor's memory."""
    if t.device.type == "cuda":
        return "VRAM", int(t.device.index or 0)
    if t.device.type != "cpu":
        raise ValueError(f"the nixl plane moves host or CUDA memory, not {t.device.type}")
    return "DRAM", 0


def span_of(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of a 2-D uint8 view (rows ``stride(0)`` apart)."""
    start = int(t.data_ptr())
    n, width = int(t.shape[0]), int(t.shape[1])
    if n == 0 or width == 0:
        return start, start
    return start, start + (n - 1) * int(t.stride(0)) + width


@dataclass
class Registered:
    mem: str
    dev: int
    start: int
    end: int
    descs: Any  # NIXL's registration list (for deregistration)


class Registry:
    """Memory this agent registered: each merged span once (module docstring)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.spans: list[Registered] = []

    def cover(self, tensors: list[torch.Tensor]) -> None:
        """Register what ``tensors`` (2-D uint8 views) span and is not registered yet;
        views over the same memory merge into one span."""
        want: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for t in tensors:
            lo, hi = span_of(t)
            if hi > lo:
                want.setdefault(mem_of(t), []).append((lo, hi))
        for (mem, dev), spans in want.items():
            for lo, hi in _merge(spans):
                if self.covers(mem, dev, lo, hi):
                    continue
                descs = self.agent.register_memory([(lo, hi - lo, dev, "")], mem)
                self.spans.append(Registered(mem, dev, lo, hi, descs))

    def covers(self, mem: str, dev: int, lo: int, hi: int) -> bool:
        return any(
            s.mem == mem and s.dev == dev and s.start <= lo and hi <= s.end for s in self.spans
        )

    def release(self) -> None:
        for s in self.spans:
            try:
                self.agent.deregister_memory(s.descs)
            except Exception:
                pass
        self.spans.clear()


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
