"""Byte sizes with binary suffixes, and small statistics helpers."""

from __future__ import annotations

import statistics

_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 1 << 10,
    "K": 1 << 10,
    "MIB": 1 << 20,
    "M": 1 << 20,
    "GIB": 1 << 30,
    "G": 1 << 30,
}


def parse_size(text: str) -> int:
    """``16KiB`` -> 16384; ``1GiB``, ``256MiB``, ``4096`` (bytes)."""
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num) :]
    if unit not in _UNITS or not num:
        raise ValueError(f"not a size: {text!r} (use e.g. 64KiB, 4MiB, 1GiB)")
    return int(float(num) * _UNITS[unit])


def parse_sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def fmt_size(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[k]
