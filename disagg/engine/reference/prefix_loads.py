"""The executor's prefix-aware scheduling: reservations, their loads, and when they retire.

Contract (``EngineConfig.prefix_aware_scheduling``, V2, a connector with all three
reservation hooks; TensorRT-LLM main's reservation and executor unit tests, cited in
docs/design/prefix-reservations.md), used by ``executor.Engine`` instead of
``get_num_new_matched_tokens``:

- admission: ``reserve_prefix(req, P, reservation_id)`` (a fresh id per attempt), the
  answer validated (a non-bool int >= 0 and a bool, never ``(0, True)``: else the request
  fails naming it); the accepted range ``[P, end)`` is block-aligned, never reaches the
  last prompt token's block, and is capped by ``prefix_load_cap_tokens``; what is not
  accepted is released (``release_prefix_reservation``) before any transmission;
- the accepted load is in that iteration's ``SchedulerOutput.prefix_loads`` (built and
  handed to ``build_connector_meta`` even when nothing computes), then marked dispatched,
  then ``start_load_kv`` (TensorRT-LLM's order: park, metadata, own, start);
- ``get_finished_prefix_loads`` on every rank every iteration; ids not dispatched and
  outstanding (stale, duplicate, unknown) are ignored; a load every rank reported is
  retired at the start of the next iteration, before scheduling (after cancels): its
  accepted range is released, then an ``is_async`` request rejoins the compute batch, or
  a request that ended meanwhile (cancelled, failed, finished) is handed back
  (``request_finished``) and its pages freed: no allocation is freed, and no request is
  answered ``request_finished``, while its load may still write. There is no timeout.
- a request ending while its load is outstanding keeps its pages until the load drains
  (``defer_load_termination``); one whose load was not dispatched yet releases it now
  (``release_unstarted_prefix_loads``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from .. import PrefixLoad
from .config import EngineConfig
from .connector_driver import Driver
from .requests import PrefixState, Request, check_reservation


class PrefixLoads:
    """The reservations and loads of one engine (``Engine.prefix``)."""

    def __init__(
        self,
        config: EngineConfig,
        driver: Driver | None,
        hand_back: Callable[[Request], None],
    ):
        self.config, self.driver = config, driver
        self._hand_back = hand_back  # request_finished, then free (Engine._hand_back)
        self._ids = itertools.count(1)
        self.accepted: list[Any] = []  # authorised this iteration, not dispatched
        self.loads: dict[int, PrefixState] = {}  # reservation id -> until retired

    def reserve(self, req: Request, P: int) -> tuple[int, bool, int | None] | str:
        """Admission with reservations: ``(accepted tokens, is_async, reservation id)``
        (``(0, False, None)``: nothing accepted, the prefix is computed here), or, when the
        answer was invalid, the message the request fails with. What is not accepted is
        released now, before any transmission."""
        cfg, drv, tpb = self.config, self.driver, self.config.tokens_per_block
        assert drv is not None
        rid = next(self._ids)  # a fresh identity per attempt
        answer = drv.sched("reserve_prefix", req, P, rid)
        try:
            n, is_async = check_reservation(answer)
        except ValueError as exc:
            promised = answer[0] if isinstance(answer, (tuple, list)) and answer else 0
            if isinstance(promised, int) and not isinstance(promised, bool) and promised > 0:
                drv.sched("release_prefix_reservation", req, rid, P, P + promised, broadcast=False)
            return f"reserve_prefix for request {req.request_id}: {exc}"
        if n == 0:
            return 0, False, None
        # block-aligned, never the last prompt token's block (computed here), capped
        end = min(P + n, (req.prompt_len - 1) // tpb * tpb)
        if cfg.prefix_load_cap_tokens is not None:
            end = min(end, P + cfg.prefix_load_cap_tokens)
        end = end // tpb * tpb
        if P % tpb or end <= P:  # rejected: the whole promise goes back
            drv.sched("release_prefix_reservation", req, rid, P, P + n, broadcast=False)
            return 0, False, None
        if end < P + n:  # clipped: the tail goes back before transmission
            drv.sched("release_prefix_reservation", req, rid, end, P + n, broadcast=False)
        return end - P, is_async, rid

    def accept(self, req: Request, P: int, N: int, is_async: bool, reservation: int) -> None:
        """After the allocation: the accepted load goes into this iteration's
        ``SchedulerOutput.prefix_loads``; an ``is_async`` request parks until every rank
        reported it."""
        load = PrefixLoad(
            reservation_id=reservation,
            request_id=req.request_id,
            start=P,
            end=P + N,
            is_async=is_async,
            block_ids_by_layer_group=[list(p) for p in req.pages],
            tokens=list(req.tokens),
            cache_salt=req.cache_salt,
        )
        self.accepted.append(load)
        self.loads[reservation] = PrefixState(load, req)
        req.prefix_load = reservation
        if is_async:
            req.state = "loading"
            req.external_load = None

    def take_accepted(self) -> list[Any]:
        """This iteration's authorised loads (for the scheduler output), not dispatched."""
        out, self.accepted = self.accepted, []
        return out

    def dispatched(self, accepted: list[Any]) -> None:
        """The metadata carrying ``accepted`` was built: owned from here, the allocation
        outlives any cancel."""
        for load in accepted:
            self.loads[load.reservation_id].dispatched = True

    def reported(self, by_rank: list[set[int]]) -> None:
        """Every rank's ``get_finished_prefix_loads`` of this iteration (rank order)."""
        for rank_i, ids in enumerate(by_rank):
            for res_id in ids:  # stale, duplicate and unknown ids are ignored
                st = self.loads.get(res_id)
                if st is not None and st.dispatched:
                    st.reported.add(rank_i)

    def retire(self) -> None:
        """Start of an iteration (after cancels, before scheduling): every load all ranks
        reported is retired: its accepted range released, then its request resumes (an
        ``is_async`` one rejoins the compute batch) or, if it ended meanwhile, is handed
        back and its pages freed."""
        n_ranks = self.config.tp
        done = sorted(r for r, st in self.loads.items() if len(st.reported) >= n_ranks)
        for res_id in done:
            st = self.loads.pop(res_id)
            req, load = st.req, st.load
            assert self.driver is not None
            self.driver.sched(
                "release_prefix_reservation",
                req,
                res_id,
                load.start,
                load.end,
                broadcast=False,
            )
            req.prefix_load = None
            if req.end_after_load:
                self._hand_back(req)
            elif req.state == "loading":
                req.state = "context"

    def defer_end(self, req: Request) -> bool:
        """A request ending while its reservation load is outstanding keeps its pages until
        the load drains (TensorRT-LLM's ``defer_load_termination``): True, the request is
        draining. One not dispatched yet is released now (``release_unstarted_prefix_loads``)
        and the request ends as usual (False)."""
        if req.prefix_load is None:
            return False
        st = self.loads.get(req.prefix_load)
        if st is not None and not st.dispatched:
            self.loads.pop(req.prefix_load)
            self.accepted = [x for x in self.accepted if x is not st.load]
            assert self.driver is not None
            self.driver.sched(
                "release_prefix_reservation",
                req,
                req.prefix_load,
                st.load.start,
                st.load.end,
                broadcast=False,
            )
            req.prefix_load = None
            return False
        req.state = "draining"
        req.end_after_load = True
        return True
