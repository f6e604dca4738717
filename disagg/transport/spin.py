"""Spin-then-block waits for the latency-bound threads of a data plane.

Why: on the H200's VM a thread that sleeps in ``select`` or on a lock takes 50-110 us to
wake, and then runs its first few hundred microseconds 2-3x slower than a busy thread
(the vCPU halted meanwhile). A single 1 GiB push crosses five such sleeps in series
(sender thread, receiver thread, ack reader, waiter, ...). A thread that was just busy
spins for a bounded window (``spin_us``) before it blocks: a message arriving within the
window is seen at once, by a warm CPU. The spin runs in C with the GIL released
(``_spin.c``), so it never holds back the interpreter's other threads; a Python polling
loop did (measured on the H200 VM: no gain).

The cost is one core per spinning thread for at most ``spin_us`` after each wake-up with
work; an idle thread blocks as before (the window restarts only after events). Off (0)
where the C module is missing, and by default on hosts with few cores
(``default_spin_us``).
"""

from __future__ import annotations

import os

from .. import tuning
from ..native import load

# the C spin (_spin.c; without a compiler at install time, threads block at once)
_spin = load("disagg.transport._spin")

# Below this many CPUs a spinning thread takes a core the peer process needs (the 2-core
# CI box: producer, consumer and their threads share two cores).
MIN_CPUS_TO_SPIN = 8
DEFAULT_SPIN_US = 2000  # a few pushes' round trips on the H200 (one 1 GiB push: ~1.5 ms)
ENV = tuning.ENV["spin_us"]  # the environment variable of the spin window


def default_spin_us() -> int:
    """``tuning.spin_us`` (``DISAGG_SPIN_US``) if set, else DEFAULT_SPIN_US on hosts with
    at least MIN_CPUS_TO_SPIN CPUs (0 below, and 0 without the C module)."""
    if _spin is None:
        return 0
    value = tuning.current().spin_us
    if value is not None:
        return value
    return DEFAULT_SPIN_US if (os.cpu_count() or 1) >= MIN_CPUS_TO_SPIN else 0


def wait_readable(fd: int, spin_ns: int, publish: list[bytearray] | None = None) -> bool:
    """Spin up to ``spin_ns`` until ``fd`` polls ready (an epoll fd: any of its watched
    descriptors). Each ``publish`` flag's first byte is set first, once the GIL is
    released (see ``_spin.c``). False at once without the C module (flags set here)."""
    if _spin is None:
        for flag in publish or ():
            flag[0] = 1
        return False
    if spin_ns <= 0 and not publish:
        return False
    return bool(_spin.wait_readable(fd, max(0, spin_ns), publish))


def wait_flag(flag: bytearray, spin_ns: int) -> bool:
    """Spin up to ``spin_ns`` until ``flag[0]`` is non-zero."""
    return bool(_spin is not None and spin_ns > 0 and _spin.wait_flag(flag, spin_ns))
