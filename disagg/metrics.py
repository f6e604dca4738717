"""Prometheus metrics for disagg, read live from the services (one source of truth).

The producer and consumer services count what they do in plain ``Counter`` objects
(``svc.metrics``) and keep their state in the block store and lease table. Rather than
mirroring those into prometheus-client objects (two sources that can drift), a custom
:class:`DisaggCollector` reads them at scrape time. Every family carries an ``instance``
label (the service's ``instance_id``), so one process may hold several services.

Families (``_total`` are counters, the rest gauges):

producer (``disagg_producer_*``)
    ``pages_pushed_total``, ``bytes_pushed_total``, ``pushes_done_total``,
    ``pushes_failed_total``, ``claims_hit_total``, ``claims_miss_total``,
    ``handshake_refused_total``, ``leases_expired_total``, ``saves_timed_out_total``,
    ``blocks_stored_total``, ``blocks_removed_total``, ``control_requests_total{kind}``;
    ``store_capacity_bytes``, ``store_used_bytes``, ``store_capacity_blocks``,
    ``store_used_blocks``, ``store_pinned_blocks``, ``store_evictions_total``,
    ``store_saves_total{outcome}``, ``leases_held``, ``leases_total{event}``.
consumer (``disagg_consumer_*``)
    ``pages_loaded_total``, ``loads_started_total``, ``loads_done_total``,
    ``loads_failed_total``, ``claims_hit_total``, ``claims_miss_total``,
    ``claims_failed_total``, ``claims_no_producer_total``, ``leases_released_total``,
    ``release_failed_total``, ``declined_unaligned_total``, ``handshake_refused_total``,
    ``claim_seconds_total``, ``producers_refusing{reason}`` (links refused now),
    ``zone_free_slots{of}`` (landing-zone slots free now, of its capacity).
both
    ``refusals_total{reason}``: handshake refusals by reason (transport/refusals.py), the
    producer's of peers it refused, the consumer's of producers refusing it.
engine (``disagg_engine_*``, only when an engine-stats function is given)
    ``iterations_total``, ``forward_passes_total``, ``computed_tokens_total``,
    ``device_matched_tokens_total``, ``connector_matched_tokens_total``,
    ``requests_finished_total``, ``requests_failed_total``.

Transfer durations are not measured by the services yet; ``disagg serve`` adds its own
request-latency histogram (``disagg_request_seconds``) to the same registry.

The TP ranks of one instance in one process (``disagg serve --tp``: ranks simulated in
it) are summed under its ``instance`` label (a store's blocks count once per rank).

Any other key a service counts is exported as ``disagg_<role>_<key>_total`` too, so a new
counter shows up without touching this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .transport.refusals import REASONS

__all__ = [
    "DisaggCollector",
    "serve_metrics",
    "PRODUCER_COUNTERS",
    "CONSUMER_COUNTERS",
    "ENGINE_COUNTERS",
]

# Always exported (as 0 before the first event) so dashboards and alerts see the series.
PRODUCER_COUNTERS: dict[str, str] = {
    "pages_pushed": "Pages pushed to consumers",
    "bytes_pushed": "Bytes pushed to consumers",
    "pushes_done": "Pushes completed",
    "pushes_failed": "Pushes that failed",
    "claims_hit": "Claims granted a lease",
    "claims_miss": "Claims that found no stored prefix",
    "handshake_refused": "Hellos refused (incompatible fingerprint or transport)",
    "leases_expired": "Leases freed by the sweeper after their TTL",
    "saves_timed_out": "Saves still in flight after save_timeout_s",
    "blocks_stored": "Blocks that became STORED",
    "blocks_removed": "Blocks removed from the store",
}
CONSUMER_COUNTERS: dict[str, str] = {
    "pages_loaded": "Pages loaded into this instance's KV cache",
    "loads_started": "Loads dispatched",
    "loads_done": "Loads completed",
    "loads_failed": "Loads that failed (the request recomputes or fails)",
    "claims_hit": "Claims that got a lease",
    "claims_miss": "Claims that found nothing",
    "claims_failed": "Claims that errored (producer unreachable, timeout)",
    "claims_no_producer": "Claims with no usable producer",
    "leases_released": "Leases released",
    "release_failed": "Lease releases that failed",
    "declined_unaligned": "Matches declined because they were not block aligned",
    "handshake_refused": "Producers newly refusing us (keys, version or fingerprint)",
    "claim_seconds": "Seconds the engine's thread spent in claims (lookups included)",
}
ENGINE_COUNTERS: dict[str, str] = {
    "iterations": "Engine iterations",
    "forward_passes": "Forward passes",
    "computed_tokens": "Tokens computed by this engine",
    "device_matched_tokens": "Prompt tokens reused from the device cache",
    "connector_matched_tokens": "Prompt tokens loaded through the connector",
    "requests_finished": "Requests finished",
    "requests_failed": "Requests failed",
}


_LIVE: dict[str, Callable[[], list[Any]]] = {}


def list_services(role: str, live: Callable[[], list[Any]]) -> None:
    """Called once by each role's service module: ``live()`` snapshots its open services.
    The collector reads services through these, so it never imports them."""
    _LIVE[role] = live


def _services(role: str) -> list[Any]:
    """The live services of ``role`` in this process (none while its module is unloaded)."""
    live = _LIVE.get(role)
    return live() if live is not None else []


def _summed(family: Metric) -> Metric:
    """``family`` with the samples of equal labels added up: the TP ranks of one instance
    in one process (``disagg serve --tp``) each count their own, under one ``instance``."""
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
    for sample in family.samples:
        key = (sample.name, tuple(sorted(sample.labels.items())))
        had = merged.get(key)
        merged[key] = sample if had is None else had._replace(value=had.value + sample.value)
    if len(merged) < len(family.samples):
        family.samples = list(merged.values())
    return family


class DisaggCollector(Collector):
    """Reads producer/consumer services (and optionally engine stats) at scrape time.

    ``engine_stats``: a callable returning a mapping like ``EngineStats.as_dict()``; it is
    called from the scraping thread, so it must be safe to call there (``disagg serve``
    hands in a snapshot the engine thread refreshes).
    """

    def __init__(self, engine_stats: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self._engine_stats = engine_stats

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic families; no up-front description (avoids an extra collect)

    def collect(self) -> Iterable[Metric]:
        families = [
            *self._counters("producer", PRODUCER_COUNTERS, _services("producer")),
            *self._producer_state(_services("producer")),
            *self._counters("consumer", CONSUMER_COUNTERS, _services("consumer")),
            *self._consumer_state(_services("consumer")),
        ]
        yield from map(_summed, families)
        if self._engine_stats is not None:
            yield from self._engine()

    @staticmethod
    def _counters(role: str, known: dict[str, str], services: list[Any]) -> Iterable[Metric]:
        families: dict[str, CounterMetricFamily] = {}
        control = CounterMetricFamily(
            f"disagg_{role}_control_requests",
            "Control requests served, by message kind",
            labels=["instance", "kind"],
        )
        refusals = CounterMetricFamily(
            f"disagg_{role}_refusals",
            "Peers refused at the handshake (producer: refused by us; consumer: refusing us), "
            "by reason",
            labels=["instance", "reason"],
        )

        def family(key: str) -> CounterMetricFamily:
            fam = families.get(key)
            if fam is None:
                doc = known.get(key, f"{role} counter {key}")
                fam = families[key] = CounterMetricFamily(
                    f"disagg_{role}_{key}", doc, labels=["instance"]
                )
            return fam

        for key in known:
            family(key)
        for svc in services:
            inst = str(svc.config.instance_id)
            counts: dict[str, float] = dict(svc.metrics)  # copy: its threads keep counting
            if role == "consumer":
                counts["claim_seconds"] = svc.claim_seconds
            for key in known:
                family(key).add_metric([inst], float(counts.get(key, 0)))
            for reason in REASONS:
                refusals.add_metric([inst, reason], float(counts.get(f"refused_{reason}", 0)))
            for key, value in counts.items():
                if key in known:
                    continue
                if key.startswith("control_"):
                    control.add_metric([inst, key[len("control_") :]], float(value))
                elif key.startswith("refused_"):
                    if key[len("refused_") :] not in REASONS:
                        refusals.add_metric([inst, key[len("refused_") :]], float(value))
                elif key.isidentifier():
                    family(key).add_metric([inst], float(value))
        yield from families.values()
        yield refusals
        if role == "producer":
            yield control

    @staticmethod
    def _producer_state(services: list[Any]) -> Iterable[Metric]:
        g = {
            name: GaugeMetricFamily(f"disagg_producer_{name}", doc, labels=["instance"])
            for name, doc in (
                ("store_capacity_bytes", "Block store capacity in bytes"),
                ("store_used_bytes", "Block store bytes in use"),
                ("store_capacity_blocks", "Block store capacity in blocks"),
                ("store_used_blocks", "Blocks held in the store"),
                ("store_pinned_blocks", "Blocks pinned by leases or pushes"),
                ("leases_held", "Leases currently held by consumers"),
            )
        }
        evictions = CounterMetricFamily(
            "disagg_producer_store_evictions", "Blocks evicted from the store", labels=["instance"]
        )
        saves = CounterMetricFamily(
            "disagg_producer_store_saves",
            "Saves into the store, by outcome",
            labels=["instance", "outcome"],
        )
        leases = CounterMetricFamily(
            "disagg_producer_leases", "Lease lifecycle events", labels=["instance", "event"]
        )
        for svc in services:
            store, table = getattr(svc, "store", None), getattr(svc, "leases", None)
            if store is None:  # not attached yet (KV caches not registered)
                continue
            inst = str(svc.config.instance_id)
            used = store.used_blocks()
            g["store_capacity_bytes"].add_metric([inst], float(store.capacity * store.block_bytes))
            g["store_used_bytes"].add_metric([inst], float(used * store.block_bytes))
            g["store_capacity_blocks"].add_metric([inst], float(store.capacity))
            g["store_used_blocks"].add_metric([inst], float(used))
            g["store_pinned_blocks"].add_metric([inst], float(store.pinned_blocks()))
            st = store.stats
            evictions.add_metric([inst], float(st.evictions))
            for outcome in (
                "planned",
                "committed",
                "dropped_full",
                "deduplicated",
                "aborted",
            ):
                saves.add_metric([inst, outcome], float(getattr(st, f"saves_{outcome}", 0)))
            if table is not None:
                g["leases_held"].add_metric([inst], float(table.active()))
                ls = table.stats
                for event in (
                    "granted",
                    "released",
                    "expired",
                    "freed_dead_owner",
                    "max_hold_exceeded",
                    "renewed",
                ):
                    leases.add_metric([inst, event], float(getattr(ls, event, 0)))
        yield from g.values()
        yield evictions
        yield saves
        yield leases

    @staticmethod
    def _consumer_state(services: list[Any]) -> Iterable[Metric]:
        refusing = GaugeMetricFamily(
            "disagg_consumer_producers_refusing",
            "Producer links refusing this consumer now, by reason (skipped until they accept)",
            labels=["instance", "reason"],
        )
        for svc in services:
            inst = str(svc.config.instance_id)
            now: dict[str, int] = dict.fromkeys(REASONS, 0)
            for rl in svc.rank_links:
                for link in rl.values():
                    got = link.refusal
                    if got is not None:
                        now[got.reason] = now.get(got.reason, 0) + 1
            for reason, n in now.items():
                refusing.add_metric([inst, reason], float(n))
        yield refusing
        free = GaugeMetricFamily(
            "disagg_consumer_zone_free_slots",
            "Landing-zone slots (one block each) free now, of the zone's capacity",
            labels=["instance", "of"],
        )
        for svc in services:
            zone = getattr(svc, "zone", None)
            if zone is not None:
                free.add_metric([str(svc.config.instance_id), str(zone.capacity)], zone.free_slots)
        yield free

    def _engine(self) -> Iterable[Metric]:
        assert self._engine_stats is not None
        stats = dict(self._engine_stats())
        for key, doc in ENGINE_COUNTERS.items():
            fam = CounterMetricFamily(f"disagg_engine_{key}", doc)
            fam.add_metric([], float(stats.get(key, 0)))
            yield fam


def serve_metrics(port: int, addr: str = "127.0.0.1") -> Any:
    """Start a background Prometheus HTTP server exporting :class:`DisaggCollector` (for a
    connector inside ``trtllm-serve``, where there is no ``disagg serve`` server to hang
    ``/metrics`` on; ``metrics.port`` and ``metrics.host`` in the config). Returns what prometheus-client returns."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(DisaggCollector())
    return start_http_server(port, addr=addr, registry=registry)
