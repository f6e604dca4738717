"""The reference engine's requests: the Python ``LlmRequest`` attributes connectors read,
the C++-bound view a V1 engine hands the scheduler's query, and what a request returns."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from ...identity import cache_salt_id
from .. import RequestData


@dataclass
class RequestResult:
    """``tokens``: generated ids; ``error``: message if the request failed; ``finished``:
    no more tokens will come. Page snapshots are filled only with ``capture_pages``:
    ``loaded_pages[(group, ordinal)]`` right after the connector's load,
    ``computed_pages[(group, ordinal)]`` when the block's KV was computed here."""

    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    finished: bool = False
    device_matched_tokens: int = 0
    connector_matched_tokens: int = 0
    loaded_pages: dict[tuple[int, int], bytes] = field(default_factory=dict)
    computed_pages: dict[tuple[int, int], bytes] = field(default_factory=dict)


@dataclass
class EngineStats:
    calls: Counter[str] = field(default_factory=Counter)  # connector calls (rank 0 / leader)
    iterations: int = 0
    forward_passes: int = 0
    device_matched_tokens: int = 0
    connector_matched_tokens: int = 0
    computed_tokens: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    forward_errors: int = 0  # forwards whose connector hooks raised (every request failed)
    load_restarts: int = 0  # requests restarted after a load reported failed
    replays: int = 0  # requests whose allocation was dropped and run again (``replay``)

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["calls"] = dict(self.calls)
        return d


@dataclass
class PrefixState:
    """An accepted reservation load until every rank reported it (then it is retired)."""

    load: Any  # PrefixLoad
    req: Request
    dispatched: bool = False
    reported: set[int] = field(default_factory=set)  # rank indices


class Request:
    """The ``LlmRequest`` attributes connectors read."""

    def __init__(
        self,
        rid: int,
        prompt: list[int],
        max_tokens: int,
        salt: str | None,
        groups: int,
        lora_task_id: int | None = None,
        multimodal_hashes: list[list[int]] | None = None,
    ):
        self.request_id = self.py_request_id = rid
        self.prompt_len = len(prompt)
        self.tokens = list(prompt)
        self.max_new_tokens = max_tokens
        self.cache_salt = salt
        # what TensorRT-LLM's LLM API derives from the salt (get_cache_salt_id), and all
        # that the C++-bound request carries of it
        self.cache_salt_id = None if salt is None else cache_salt_id(salt)
        self.lora_task_id = lora_task_id
        self.multimodal_hashes = multimodal_hashes
        self.multimodal_positions = [0] * len(multimodal_hashes) if multimodal_hashes else None
        self.multimodal_lengths = (
            [len(prompt)] * len(multimodal_hashes) if multimodal_hashes else None
        )
        self.kv_cache_retention_config = None
        self.py_draft_tokens: list[int] = []
        self.is_dummy_request = False
        self.is_generation_only_request = False
        self.state = "waiting"  # waiting|context|loading|generation|finishing|saving|done
        self.context_current_position = 0
        self.context_chunk_size = 0
        self.py_num_connector_matched_tokens = self.num_connector_matched_tokens = 0
        self.pages: list[list[int]] = [[] for _ in range(groups)]
        self.hashes: list[bytes] = []
        self.queried = False
        self.forwarded = False
        self.P = self.N = 0
        self.external_load: int | None = None
        self.reported = False
        self.rep_tokens = 0
        self.rep_pages = [0] * groups
        self.sampled_iter = -1
        self.finished_iter = -1
        self.generated: list[int] = []
        self.prefix_load: int | None = None  # its reservation load, until retired
        self.end_after_load = False  # ended while its load was outstanding: handed back later

    @property
    def adapter(self) -> str | None:
        """What besides the tokens changes this request's KV in the model (its LoRA task
        and multimodal inputs), or None: the model embeds with it, block hashes cover it."""
        if self.lora_task_id is None and not self.multimodal_hashes:
            return None
        return repr((self.lora_task_id, self.multimodal_hashes))

    def get_tokens(self, beam: int = 0) -> list[int]:
        return list(self.tokens)

    @property
    def context_remaining_length(self) -> int:
        return max(0, self.prompt_len - self.context_current_position)

    @property
    def is_first_context_chunk(self) -> bool:
        return not self.forwarded

    def cpp_view(self) -> CppRequest:
        """What a V1 engine's C++ ``addSequence`` hands ``get_num_new_matched_tokens``."""
        return CppRequest(self)

    def __repr__(self) -> str:
        return f"Request(id={self.request_id}, state={self.state}, prompt_len={self.prompt_len})"


class CppRequest:
    """The C++-bound ``LlmRequest`` as nanobind exposes it: request id, tokens, prompt
    length, ``cache_salt_id`` (no ``cache_salt`` string), LoRA task and multimodal inputs.
    A V1 engine queries the connector with this object (C++ casts the request to its base
    class), so nothing set only on the Python request is readable through it."""

    _BOUND = (
        "request_id",
        "py_request_id",
        "prompt_len",
        "cache_salt_id",
        "lora_task_id",
        "multimodal_hashes",
        "multimodal_positions",
        "multimodal_lengths",
        "is_generation_only_request",
        "is_dummy_request",
        "context_current_position",
        "kv_cache_retention_config",
    )

    def __init__(self, req: Request):
        object.__setattr__(self, "_req", req)

    def __getattr__(self, name: str) -> Any:
        if name in CppRequest._BOUND:
            return getattr(self._req, name)
        raise AttributeError(f"the C++-bound LlmRequest has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "state":  # the engine keeps its own states
            setattr(self._req, name, value)  # the manager records matched tokens on it

    def get_tokens(self, beam: int = 0) -> list[int]:
        return self._req.get_tokens(beam)


def check_reservation(answer: Any) -> tuple[int, bool]:
    """``reserve_prefix``'s answer as TensorRT-LLM validates it (UT-RES): a non-bool int
    >= 0 and a bool, never ``(0, True)``; else ``ValueError`` naming what is wrong."""
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        raise ValueError(f"reserve_prefix must return (tokens, is_async), not {answer!r}")
    n, is_async = answer
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"reserve_prefix returned token count {n!r}: not an int >= 0")
    if not isinstance(is_async, bool):
        raise ValueError(f"reserve_prefix returned is_async {is_async!r}: not a bool")
    if n == 0 and is_async:
        raise ValueError("reserve_prefix returned (0, True): an async load of no tokens")
    return n, is_async


def request_data(**kw: Any) -> Any:
    """The line's ``RequestData`` from the fields it has (older lines lack some)."""
    names = {f.name for f in fields(RequestData)}
    return RequestData(**{k: v for k, v in kw.items() if k in names})


def report(
    req: Request, kv_manager: str, grouped_as: str | None, lag: int, hashes: list[bytes]
) -> Any:
    """The request's ``RequestData`` for this iteration's ``SchedulerOutput``: what changed
    since it was last reported (tokens: all but the last ``lag``, which the overlap
    scheduler has not appended yet; pages), its computed position and scheduled tokens;
    V1: the hashes of its full blocks (``hashes``), V2: its pages per layer group in the
    line's form (``grouped_as``)."""
    visible = req.tokens[: len(req.tokens) - lag]
    new_tokens = visible[req.rep_tokens :]
    req.rep_tokens = len(visible)
    deltas = [list(p[req.rep_pages[g] :]) for g, p in enumerate(req.pages)]
    req.rep_pages = [len(p) for p in req.pages]
    grouped: Any
    if kv_manager == "v1":
        flat, grouped = deltas[0], ({} if grouped_as == "dict" else [])
        block_hashes = [int.from_bytes(h[:8], "big") for h in hashes]
    else:
        flat, grouped = (deltas[0] if len(deltas) == 1 else []), deltas
        if grouped_as == "dict":
            grouped = dict(enumerate(deltas))
        block_hashes = []
    if req.state == "generation":
        cp, nst = len(req.tokens) - 1, 1
    else:
        cp = req.context_current_position - (req.external_load or 0)
        nst = req.context_chunk_size
    req.reported = True
    return request_data(
        request_id=req.request_id,
        new_tokens=new_tokens,
        new_block_ids=flat,
        computed_position=cp,
        num_scheduled_tokens=nst,
        block_hashes=block_hashes,
        priorities=None,
        cache_salt=req.cache_salt,
        cache_salt_id=req.cache_salt_id,
        new_block_ids_by_layer_group=grouped,
    )
