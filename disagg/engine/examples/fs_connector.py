"""A persistent KV cache on the file system, in both connector forms.

* ``FsConnectorScheduler`` / ``FsConnectorWorker``: flat-only (``update_state_after_alloc``,
  ``request_finished``, ``register_kv_caches``): single-window models, V1 or V2.
* ``FsGroupedConnectorScheduler`` / ``FsGroupedConnectorWorker``: per-layer-group forms
  (``*_by_layer_group``, ``register_kv_cache_layout``): every model, VSWA included.

One file per (block, layer group, TP rank): ``<key>.g<group>.r<rank>of<world>.kv`` holding
the raw bytes of that page. The key chains the prefix (``sha256(previous key + block
tokens)``) and is seeded with the cache salt, the model name and the block size, so two
prompts sharing a block but not its prefix never collide, and a different salt misses. The
group is in the file name because the same tokens hold different KV in each group.

Directory: ``llm_args.disagg["fs_connector_dir"]``, else ``$DISAGG_FS_CONNECTOR_DIR``, else
``./disagg_fs_cache``. Loads run synchronously in ``start_load_kv``; saves in
``wait_for_save`` (after the forward wrote the pages). Setting ``disagg["fs_async_load"]``
(or ``DISAGG_FS_CONNECTOR_ASYNC=1``) answers the query asynchronously instead: the load is
planned from ``update_state_after_alloc`` (the request is parked, absent from the
``SchedulerOutput``) and reported through ``get_finished``.

Rules it follows: a non-block-aligned device match is declined; the last prompt token is
never offered; a block is served only if every group (and every TP rank) holds it; page
lists are filtered with ``valid_page_slots`` (``-1`` = no page); saves are planned from both
``new_requests`` and ``cached_requests`` so chunked prefill works.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from disagg.engine import KvCacheConnectorScheduler, KvCacheConnectorWorker, valid_page_slots
from disagg.engine.runtime import runtime_rank
from disagg.identity import salt_token

ENV_DIR = "DISAGG_FS_CONNECTOR_DIR"
ENV_ASYNC = "DISAGG_FS_CONNECTOR_ASYNC"


def _cache_dir(llm_args: Any) -> Path:
    extra = getattr(llm_args, "disagg", None) or {}
    d = Path(extra.get("fs_connector_dir") or os.environ.get(ENV_DIR) or "./disagg_fs_cache")
    d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass
class FsMeta:
    """Picklable plan for one iteration: ``(key, group, slot)`` triples."""

    load: list[tuple[str, int, int]] = field(default_factory=list)
    save: list[tuple[str, int, int]] = field(default_factory=list)
    loaded_requests: list[int] = field(default_factory=list)  # async loads carried here


@dataclass
class _ReqState:
    tokens: list[int] = field(default_factory=list)
    pages: list[list[int]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    saved_upto: int = 0  # block ordinal
    salt: str | None = None


class _SchedulerBase:
    """Shared leader logic; ``_grouped`` picks which callback form feeds it."""

    _grouped = False

    def _init(self, llm_args: Any) -> None:
        self.tpb = int(llm_args.kv_cache_config.tokens_per_block)
        self.dir = _cache_dir(llm_args)
        self.world = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
        windows = llm_args.kv_cache_config.max_attention_window or [None]
        max_seq = getattr(llm_args, "max_seq_len", None)
        eff = []
        for w in windows:  # effective windows, first-appearance order = group order
            e = None if w is None or w <= 0 or (max_seq and w >= max_seq) else int(w)
            if e not in eff:
                eff.append(e)
        self.num_groups = len(eff) if self._grouped else 1
        extra = getattr(llm_args, "disagg", None) or {}
        self.async_load = bool(extra.get("fs_async_load") or os.environ.get(ENV_ASYNC) == "1")
        self.seed = f"{getattr(llm_args, 'model', '')}|tpb={self.tpb}"
        self.state: dict[int, _ReqState] = {}
        self.pending_loads: dict[int, tuple[int, list[str]]] = {}  # rid -> (first ordinal, keys)
        self.async_plan: list[tuple[str, int, int]] = []
        self.async_ids: list[int] = []

    # keys -------------------------------------------------------------------------------
    def _keys(
        self, tokens: list[int], salt: str | None, nblocks: int, prev: list[str]
    ) -> list[str]:
        keys = list(prev)
        h = keys[-1] if keys else hashlib.sha256(f"{self.seed}|salt={salt}".encode()).hexdigest()
        for b in range(len(keys), nblocks):
            blk = tokens[b * self.tpb : (b + 1) * self.tpb]
            h = hashlib.sha256((h + "|" + ",".join(map(str, blk))).encode()).hexdigest()
            keys.append(h)
        return keys

    def _path(self, key: str, group: int, rank: int) -> Path:
        return self.dir / f"{key}.g{group}.r{rank}of{self.world}.kv"

    def _held(self, key: str) -> bool:
        return all(
            self._path(key, g, r).exists()
            for g in range(self.num_groups)
            for r in range(self.world)
        )

    # engine-facing ------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Whole blocks beyond the device match held for every group/rank, stopping one
        token short of the prompt. A non-block-aligned device match is declined."""
        rid = request.request_id
        if num_computed_tokens % self.tpb:
            return 0, False
        tokens = list(request.get_tokens(0))[: request.prompt_len]
        max_blocks = (len(tokens) - 1) // self.tpb  # never offer the last prompt token
        keys = self._keys(tokens, salt_token(request), max_blocks, [])
        first = num_computed_tokens // self.tpb
        got: list[str] = []
        for b in range(first, max_blocks):
            if not self._held(keys[b]):
                break
            got.append(keys[b])
        if not got:
            return 0, False
        self.pending_loads[rid] = (first, got)
        return len(got) * self.tpb, self.async_load

    def _after_alloc(self, request: Any, pages: list[list[int]]) -> None:
        rid = request.request_id
        if not self.async_load or rid not in self.pending_loads:
            return
        # Async: the request is parked and never appears in this SchedulerOutput, so the
        # load is planned here and carried by this iteration's metadata.
        first, keys = self.pending_loads.pop(rid)
        self.async_plan += self._load_plan(first, keys, pages)
        self.async_ids.append(rid)

    def _load_plan(
        self, first: int, keys: list[str], pages: list[list[int]]
    ) -> list[tuple[str, int, int]]:
        plan = []
        for g, lst in enumerate(pages):
            valid = dict(valid_page_slots(lst))
            for i, key in enumerate(keys):
                slot = valid.get(first + i)
                if slot is not None:  # no page in this group (outside the window): skip
                    plan.append((key, g, slot))
        return plan

    def build_connector_meta(self, scheduler_output: Any) -> FsMeta:
        """Loads for first reports of synchronously matched requests; saves of every block
        whose tokens and KV are complete after this pass, from both lists."""
        meta = FsMeta(load=self.async_plan, loaded_requests=self.async_ids)
        self.async_plan, self.async_ids = [], []
        for rd in list(scheduler_output.new_requests) + list(scheduler_output.cached_requests):
            st = self.state.get(rd.request_id)
            if st is None:
                # Blocks below the first computed position were matched on the device,
                # i.e. computed (and saved) by an earlier request: start saving after them.
                st = self.state[rd.request_id] = _ReqState(
                    pages=[[] for _ in range(self.num_groups)],
                    salt=salt_token(rd),  # the string, or the id on one line
                    saved_upto=rd.computed_position // self.tpb,
                )
            st.tokens += list(rd.new_tokens)
            by_group = getattr(rd, "new_block_ids_by_layer_group", None) or []
            if isinstance(by_group, dict):
                by_group = [by_group[k] for k in sorted(by_group)]
            deltas = by_group if (self._grouped and by_group) else [list(rd.new_block_ids)]
            if len(deltas) != self.num_groups:
                raise RuntimeError(
                    f"expected {self.num_groups} layer group(s), the engine reported {len(deltas)}"
                )
            for g, d in enumerate(deltas):
                st.pages[g] += list(d)
            if rd.request_id in self.pending_loads:
                first, keys = self.pending_loads.pop(rd.request_id)
                meta.load += self._load_plan(first, keys, st.pages)
                st.saved_upto = max(st.saved_upto, first + len(keys))
            end = rd.computed_position + rd.num_scheduled_tokens
            done = min(end, len(st.tokens)) // self.tpb
            st.keys = self._keys(st.tokens, st.salt, done, st.keys)
            for b in range(st.saved_upto, done):
                for g in range(self.num_groups):
                    lst = st.pages[g]
                    if b < len(lst) and lst[b] >= 0:
                        meta.save.append((st.keys[b], g, lst[b]))
            st.saved_upto = max(st.saved_upto, done)
        return meta

    def _finished(self, request: Any) -> bool:
        self.state.pop(request.request_id, None)
        self.pending_loads.pop(request.request_id, None)
        return False  # saves are synchronous, in wait_for_save


class FsConnectorScheduler(_SchedulerBase, KvCacheConnectorScheduler):
    """Flat-only leader."""

    def __init__(self, llm_args: Any):
        super().__init__(llm_args)
        self._init(llm_args)

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        self._after_alloc(request, [list(block_ids)])

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return self._finished(request)


class FsGroupedConnectorScheduler(_SchedulerBase, KvCacheConnectorScheduler):
    """Per-layer-group leader (VSWA)."""

    _grouped = True

    def __init__(self, llm_args: Any):
        super().__init__(llm_args)
        self._init(llm_args)

    def update_state_after_alloc_by_layer_group(
        self, request: Any, block_ids_by_layer_group: list[list[int]]
    ) -> None:
        self._after_alloc(request, [list(x) for x in block_ids_by_layer_group])

    def request_finished_by_layer_group(
        self, request: Any, cache_block_ids_by_layer_group: list[list[int]]
    ) -> bool:
        return self._finished(request)


class _WorkerBase:
    def _init(self, llm_args: Any) -> None:
        self.dir = _cache_dir(llm_args)
        self.rank = runtime_rank()  # the runtime's (mpi_rank), never llm_args
        self.world = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
        self.pages: dict[int, Any] = {}  # group -> callable(slot) -> uint8 view of that page
        self.loaded: set[int] = set()
        self.handed_loading: set[int] = set()

    def _path(self, key: str, group: int) -> Path:
        return self.dir / f"{key}.g{group}.r{self.rank}of{self.world}.kv"

    def start_load_kv(self, stream: Any) -> None:
        meta: FsMeta = self._metadata  # type: ignore[attr-defined]
        if meta is None:
            return
        for key, g, slot in meta.load:
            dst = self.pages[g](slot)
            data = self._path(key, g).read_bytes()
            if len(data) != dst.numel():
                raise RuntimeError(
                    f"page file {key} g{g} has {len(data)} bytes, page {dst.numel()}"
                )
            dst.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dst.device))
        self.loaded.update(meta.loaded_requests)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        pass

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        pass

    def wait_for_save(self, stream: Any) -> None:
        meta: FsMeta = self._metadata  # type: ignore[attr-defined]
        if meta is None:
            return
        stream.synchronize()
        for key, g, slot in meta.save:
            path = self._path(key, g)
            if path.exists():
                continue
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(self.pages[g](slot).cpu().numpy().tobytes())
            os.replace(tmp, path)  # atomic: a reader never sees a partial page

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        self.handed_loading.update(started_loading_req_ids)
        done = sorted(self.handed_loading & self.loaded)
        self.handed_loading -= set(done)
        self.loaded -= set(done)
        return [], done


def _rows(tensor: torch.Tensor) -> Any:
    flat = tensor.view(tensor.shape[0], -1)
    return lambda slot: flat[slot].view(torch.uint8) if slot >= 0 else _bad(slot)


def _bad(slot: int) -> Any:
    raise IndexError(f"page slot {slot} names no page")


class FsConnectorWorker(_WorkerBase, KvCacheConnectorWorker):
    """Flat-only worker: one ``[num_blocks, num_layers, 2, block_size]`` tensor."""

    def __init__(self, llm_args: Any):
        super().__init__(llm_args)
        self._init(llm_args)

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        self.pages[0] = _rows(kv_cache_tensor)


class FsGroupedConnectorWorker(_WorkerBase, KvCacheConnectorWorker):
    """Per-layer-group worker: pages addressed through each group's region."""

    def __init__(self, llm_args: Any):
        super().__init__(llm_args)
        self._init(llm_args)

    def register_kv_cache_layout(self, layout: Any) -> None:
        for group in layout.groups:
            if len(group.regions) != 1:
                raise NotImplementedError(
                    f"layer group {group.layer_group_id} has {len(group.regions)} regions"
                )
            region = group.regions[0]
            self.pages[group.layer_group_id] = region.slot_tensor
