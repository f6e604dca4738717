"""The proxy's time bounds: every wait on an upstream has a deadline derived from the request.

    wait                          bound (flag, default)
    prefill on one producer       prefill_floor_s + prompt tokens x prefill_per_token_s
                                  (--prefill-floor-s 10, --prefill-per-token-s 0.005)
    decode on one consumer        decode_floor_s + prompt tokens x prefill_per_token_s
                                  + max_tokens x decode_per_token_s
                                  (--decode-floor-s 30, --decode-per-token-s 0.1)
    either, at most               --timeout (600)
    upstream marked down          missed_heartbeats x heartbeat_s without a /health
                                  answer (--heartbeat-s 1, --missed-heartbeats 3), at once
                                  on a refused connection, a non-200 /health or an
                                  expired deadline
    /disagg/seed on the request   SEED_WAIT_S (0.1 s); the fetch goes on in the background
    prefix preference             a producer holding the longest prefix is preferred only
                                  while its in-flight prefills exceed the least loaded
                                  producer's by at most --prefix-load-skew (2): a prefix
                                  every prompt shares must not send all prefill to one

A prefill or decode whose deadline expires marks that upstream down and the request moves
to the next one (down upstreams are tried last); an upstream comes back when a heartbeat
is answered 200 (after an expired deadline, no sooner than ``missed_heartbeats x
heartbeat_s``). So a request costs at most one prefill deadline per producer tried, plus
its decode deadline per consumer tried before the first byte reached the client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

# The longest a request waits for a namespace seed it lacks (a miss only costs routing).
SEED_WAIT_S = 0.1


@dataclass(frozen=True)
class ProxyLimits:
    prefill_floor_s: float = 10.0
    prefill_per_token_s: float = 0.005
    decode_floor_s: float = 30.0
    decode_per_token_s: float = 0.1
    request_timeout_s: float = 600.0
    heartbeat_s: float = 1.0
    missed_heartbeats: int = 3
    prefix_load_skew: int = 2

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            flag = _FLAGS[f.name]
            if f.name in ("missed_heartbeats", "prefix_load_skew"):
                least = 1 if f.name == "missed_heartbeats" else 0
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    raise ValueError(
                        f"{flag}: must be an integer >= {least}, got {value!r}; e.g. {f.default}"
                    )
                continue
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"{flag}: must be a number of seconds > 0, got {value!r}; e.g. {f.default}"
                )
        if self.heartbeat_s > self.request_timeout_s:
            raise ValueError(
                f"--heartbeat-s ({self.heartbeat_s}) must not exceed --timeout "
                f"({self.request_timeout_s}): an upstream would be judged slower than requests"
            )

    def prefill_s(self, prompt_tokens: int) -> float:
        """Deadline of one prefill attempt for a prompt of ``prompt_tokens``."""
        bound = self.prefill_floor_s + prompt_tokens * self.prefill_per_token_s
        return min(bound, self.request_timeout_s)

    def decode_s(self, prompt_tokens: int, max_tokens: int) -> float:
        """Deadline of one decode attempt (the consumer may have to recompute the prompt)."""
        bound = (
            self.decode_floor_s
            + prompt_tokens * self.prefill_per_token_s
            + max_tokens * self.decode_per_token_s
        )
        return min(bound, self.request_timeout_s)

    @property
    def down_after_s(self) -> float:
        """Silence after which an upstream counts as down."""
        return self.heartbeat_s * self.missed_heartbeats


_FLAGS = {
    "prefix_load_skew": "--prefix-load-skew",
    "prefill_floor_s": "--prefill-floor-s",
    "prefill_per_token_s": "--prefill-per-token-s",
    "decode_floor_s": "--decode-floor-s",
    "decode_per_token_s": "--decode-per-token-s",
    "request_timeout_s": "--timeout",
    "heartbeat_s": "--heartbeat-s",
    "missed_heartbeats": "--missed-heartbeats",
}
