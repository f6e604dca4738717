"""Request traces in the Mooncake format: loading, synthesis, block keys and prompts.

A trace is JSON lines, one request each::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

``timestamp`` is the arrival in milliseconds from the first request, ``hash_ids`` one id
per ``block_tokens`` (512) tokens of the prompt; equal ids at the same position mean the
same prefix content (the last block may be partial). Requests are taken in arrival order
(a stable sort by timestamp: file order for a sorted file).

- :func:`load_trace` reads a file into a :class:`Trace` (numpy arrays; ids flat with
  offsets); a bad line raises :class:`TraceError` naming the file, line and field.
- :func:`synthetic_trace` makes one: Poisson arrivals at ``rate`` per second, lengths from
  exponential-like (geometric) distributions around the given means, and for each request,
  with probability ``shared_ratio``, a prefix taken from one of ``groups`` shared documents
  (Zipf-like popularity), the rest fresh ids.
- :func:`block_keys_of` gives every request's full-block keys as the connectors compute
  them (:func:`disagg.protocol.keys.block_key_blob`, one trace block = one "token", so the
  chain ``h_i = xxh3_128(h_{i-1} || id_i)`` holds exactly when the prefixes are equal).
- :func:`prompt_tokens` turns a request into token ids: each hash id maps to a fixed,
  seeded block of token ids (a vectorised splitmix64 of ``(seed, id, position)``), the
  blocks are concatenated and cut to the input length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces


class TraceError(ValueError):
    pass


@dataclass
class Trace:
    """``n`` requests in arrival order; request i's ids are ``ids[offsets[i]:offsets[i+1]]``."""

    timestamp_ms: np.ndarray  # float64
    input_length: np.ndarray  # int64
    output_length: np.ndarray  # int64
    ids: np.ndarray  # int64, flat
    offsets: np.ndarray  # int64, n + 1
    block_tokens: int = BLOCK_TOKENS
    source: str = "synthetic"

    def __len__(self) -> int:
        return len(self.input_length)

    def ids_of(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    def full_blocks(self) -> np.ndarray:
        """Full blocks per request (the only ones a block store keeps)."""
        n_ids = np.diff(self.offsets)
        return np.minimum(self.input_length // self.block_tokens, n_ids)

    def head(self, limit: int | None) -> Trace:
        if limit is None or limit >= len(self):
            return self
        end = int(self.offsets[limit])
        return Trace(
            self.timestamp_ms[:limit],
            self.input_length[:limit],
            self.output_length[:limit],
            self.ids[:end],
            self.offsets[: limit + 1],
            self.block_tokens,
            self.source,
        )

    def to_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for i in range(len(self)):
                row = {
                    "timestamp": float(self.timestamp_ms[i]),
                    "input_length": int(self.input_length[i]),
                    "output_length": int(self.output_length[i]),
                    "hash_ids": self.ids_of(i).tolist(),
                }
                f.write(json.dumps(row) + "\n")


def _field(d: dict, name: str, where: str) -> int | float:
    v = d.get(name)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
        raise TraceError(f"{where}: '{name}' must be a number >= 0, got {v!r}")
    return v


def load_trace(path: str | Path, limit: int | None = None) -> Trace:
    """Read a Mooncake-format trace (the first ``limit`` lines when given)."""
    ts: list[float] = []
    ins: list[int] = []
    outs: list[int] = []
    ids: list[list[int]] = []
    try:
        f = open(path)  # noqa: SIM115 - closed below
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(ts) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(d, dict):
                raise TraceError(f"{where}: expected an object, got {type(d).__name__}")
            h = d.get("hash_ids")
            if not isinstance(h, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in h
            ):
                raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
            ts.append(float(_field(d, "timestamp", where)))
            ins.append(int(_field(d, "input_length", where)))
            outs.append(int(_field(d, "output_length", where)))
            ids.append(h)
    if not ts:
        raise TraceError(f"{path}: no requests")
    counts = np.fromiter((len(h) for h in ids), dtype=np.int64, count=len(ids))
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = np.fromiter((x for h in ids for x in h), dtype=np.int64, count=int(offsets[-1]))
    trace = Trace(
        np.asarray(ts),
        np.asarray(ins, dtype=np.int64),
        np.asarray(outs, dtype=np.int64),
        flat,
        offsets,
        source=str(path),
    )
    return _sorted(trace)


def _sorted(t: Trace) -> Trace:
    order = np.argsort(t.timestamp_ms, kind="stable")
    if np.all(order == np.arange(len(t))):
        return t
    counts = np.diff(t.offsets)[order]
    offsets = np.zeros(len(t) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = np.concatenate([t.ids_of(int(i)) for i in order]) if len(t) else t.ids
    return Trace(
        t.timestamp_ms[order],
        t.input_length[order],
        t.output_length[order],
        flat.astype(np.int64),
        offsets,
        t.block_tokens,
        t.source,
    )


def synthetic_trace(
    n: int,
    *,
    rate: float = 2.0,
    mean_input: int = 4096,
    mean_output: int = 128,
    shared_ratio: float = 0.5,
    groups: int = 8,
    seed: int = 0,
    block_tokens: int = BLOCK_TOKENS,
) -> Trace:
    """``n`` requests (see the module docstring); each shared request takes a prefix of a
    random length (up to the whole document) of one of ``groups`` documents."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1000.0 / rate, size=n) if rate > 0 else np.zeros(n)
    ts = np.concatenate([[0.0], np.cumsum(gaps[1:])]) if n else np.zeros(0)
    ins = np.maximum(1, rng.geometric(1.0 / max(1, mean_input), size=n)).astype(np.int64)
    outs = np.maximum(1, rng.geometric(1.0 / max(1, mean_output), size=n)).astype(np.int64)
    doc_blocks = max(1, -(-2 * mean_input // block_tokens))
    pop = 1.0 / np.arange(1, groups + 1)
    pick = rng.choice(groups, size=n, p=pop / pop.sum())
    shared = rng.random(n) < shared_ratio
    next_id = groups * doc_blocks  # ids below are the documents' blocks
    rows: list[np.ndarray] = []
    for i in range(n):
        nb = int(-(-ins[i] // block_tokens))
        k = int(rng.integers(1, min(nb, doc_blocks) + 1)) if shared[i] else 0
        head = np.arange(k, dtype=np.int64) + int(pick[i]) * doc_blocks
        tail = np.arange(next_id, next_id + nb - k, dtype=np.int64)
        next_id += nb - k
        rows.append(np.concatenate([head, tail]))
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    flat = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return Trace(ts, ins, outs, flat, offsets, block_tokens)


def block_keys_of(trace: Trace, seed: bytes) -> tuple[bytes, np.ndarray]:
    """Every request's full-block keys, back to back, and their offsets (in keys)."""
    from ..protocol.keys import block_key_blob

    full = trace.full_blocks()
    offsets = np.zeros(len(trace) + 1, dtype=np.int64)
    np.cumsum(full, out=offsets[1:])
    parts = [
        block_key_blob(seed, trace.ids[int(a) : int(a) + int(k)], 1).blob
        for a, k in zip(trace.offsets[:-1].tolist(), full.tolist())
    ]
    return b"".join(parts), offsets


def unbounded_hit_blocks(keys: bytes, key_offsets: np.ndarray) -> np.ndarray:
    """Per request, the full blocks an unbounded cache holds on arrival: a block's key was
    seen in an earlier request. Chained keys make those a prefix, so this is the count of
    keys that are not their first occurrence (one ``np.unique`` over the 16-byte keys)."""
    arr = np.frombuffer(keys, dtype=np.dtype([("a", "<u8"), ("b", "<u8")]))
    n_req = len(key_offsets) - 1
    if len(arr) == 0:
        return np.zeros(n_req, dtype=np.int64)
    _, first = np.unique(arr, return_index=True)
    repeat = np.ones(len(arr), dtype=bool)
    repeat[first] = False
    req_of = np.repeat(np.arange(n_req), np.diff(key_offsets))
    return np.bincount(req_of[repeat], minlength=n_req).astype(np.int64)


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = x + _GOLD
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def prompt_tokens(
    ids: np.ndarray, input_length: int, block_tokens: int, vocab: int, seed: int = 0
) -> list[int]:
    """The prompt of a request whose blocks are ``ids`` (see the module docstring)."""
    n_blocks = -(-input_length // block_tokens)
    ids = np.asarray(ids[:n_blocks], dtype=np.int64)
    if len(ids) < n_blocks:  # a trace line with fewer ids than its length needs: fresh ids
        extra = np.arange(n_blocks - len(ids), dtype=np.int64) - (1 << 40) - int(ids.sum())
        ids = np.concatenate([ids, extra])
    with np.errstate(over="ignore"):
        base = _splitmix(ids.astype(np.uint64) ^ _splitmix(np.uint64(seed) + np.zeros(1, "u8")))
        pos = np.arange(block_tokens, dtype=np.uint64)
        toks = _splitmix(base[:, None] + pos[None, :] * _GOLD) % np.uint64(vocab)
    return toks.reshape(-1)[:input_length].astype(np.int64).tolist()


def scaled(trace: Trace, length_scale: float, max_seq_len: int | None = None) -> Trace:
    """Input/output lengths and the block size multiplied by ``length_scale`` (at least 1
    token each), so the prefix structure survives on a small machine; with ``max_seq_len``,
    inputs are cut so that input + output fits."""
    ins = np.maximum(1, np.rint(trace.input_length * length_scale)).astype(np.int64)
    outs = np.maximum(1, np.rint(trace.output_length * length_scale)).astype(np.int64)
    if max_seq_len is not None:
        outs = np.minimum(outs, max(1, max_seq_len // 4))
        ins = np.minimum(ins, max_seq_len - outs)
    bt = max(1, int(round(trace.block_tokens * length_scale)))
    return Trace(trace.timestamp_ms, ins, outs, trace.ids, trace.offsets, bt, trace.source)
