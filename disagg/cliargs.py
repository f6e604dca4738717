"""Argument parsing shared by every ``disagg`` command line.

Bad input is answered with ONE line on stderr naming the argument, the value and what is
accepted, and exit status 2; never a traceback (an operator reads the line, not a stack).
:class:`Parser` does that for argparse's own errors (argparse prints the usage block
first); the ``type=`` helpers below make the message say what would be accepted; and
:func:`usage` is for checks made after parsing (``--device cuda`` without CUDA...).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, NoReturn

EXIT_USAGE = 2


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help; descriptions keep their line breaks."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``PROG: argument --x: ...; see --help``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


class UsageError(ValueError):
    """A bad argument found after parsing: ``arg``, ``value`` and what is accepted."""

    def __init__(self, arg: str, value: Any, accepted: str) -> None:
        super().__init__(f"argument {arg}: {value!r}: {accepted}")
        self.arg, self.value, self.accepted = arg, value, accepted


def usage(prog: str, message: str) -> int:
    """Print one usage line for ``prog``; returns the exit status to use (2)."""
    print(f"{prog}: {message}", file=sys.stderr)
    return EXIT_USAGE


def _typed(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    parse.__name__ = name  # argparse names the type in "invalid <name> value: 'x'"
    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a whole number; give an integer >= {low}"
            ) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}; give an integer >= {low}")
        return value

    return _typed(f"integer >= {low}", parse)


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def transport(text: str) -> str:
    """A data plane name (``config.TRANSPORTS``); a former name is refused naming its
    new one."""
    from .config import RENAMED_TRANSPORTS, TRANSPORTS

    if text in RENAMED_TRANSPORTS:
        raise argparse.ArgumentTypeError(RENAMED_TRANSPORTS[text])
    if text not in TRANSPORTS:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(TRANSPORTS)}")
    return text


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a number > 0") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number > 0")
    return value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; give 0-65535") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is out of range; give a port 0-65535")
    return value


def int_list(text: str) -> list[int]:
    """``"1024,8192"`` -> [1024, 8192]: whole numbers >= 1, no suffixes."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            value = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a whole number; give comma-separated integers, e.g. 1024,8192"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value}: every entry must be >= 1")
        out.append(value)
    if not out:
        raise argparse.ArgumentTypeError("empty list; give e.g. 1024,8192")
    return out


def size(text: str) -> int:
    """A byte size with a binary suffix (``64KiB``, ``4MiB``, ``1GiB``) or plain bytes."""
    from .bench.units import parse_size

    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use bytes or a binary suffix: 64KiB, 4MiB, 1GiB "
            "(KB/MB/GB are ambiguous and not accepted)"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return value


def size_list(text: str) -> list[int]:
    out = [size(s) for s in text.split(",") if s.strip()]
    if not out:
        raise argparse.ArgumentTypeError("empty list; give e.g. 64KiB,1MiB")
    return out


def cuda_problem(device: str) -> str | None:
    """Why ``device`` cannot be used here (``None`` when it can): only ``cpu``,
    ``cuda`` and ``cuda:N`` are names, and CUDA needs a CUDA build of torch and a GPU."""
    if device == "cpu":
        return None
    index = device[5:] if device.startswith("cuda:") else ("" if device == "cuda" else None)
    if index is None or (index and not index.isdigit()):
        return "accepted: cpu, cuda or cuda:N"
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda is not None
        why = "no CUDA device is visible" if built else "this torch is a CPU-only build"
        return f"{why}; use --device cpu"
    if index and int(index) >= torch.cuda.device_count():
        return f"only {torch.cuda.device_count()} CUDA device(s) here; use cuda:0..."
    return None
