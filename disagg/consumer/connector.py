"""The consumer's engine adapter: TensorRT-LLM's scheduler/worker hooks over ``ConsumerService``.

Load with ``connector_module: disagg.consumer``, ``ConsumerScheduler`` / ``ConsumerWorker``.

Scheduler (``scheduler.py``; leader only: rank 0 under TP; never waits past a deadline):

- ``get_num_new_matched_tokens(request, P)``, once per allocation: offers whole blocks past
  a block-aligned device match ``P``, never the last prompt token, only blocks a producer
  holds in every layer group and has leased to us; any failure before the answer is a miss.
- ``update_state_after_alloc[_by_layer_group]``: where the claimed blocks land (``-1``: not
  loaded); only what the runtime honoured (``py_num_connector_matched_tokens``, or the range
  before ``cancel_load``'s start) is loaded, the rest of the lease goes back at once.
- ``build_connector_meta``: ``ConsumerMeta`` (``metadata.py``) of the loads that start now.
- ``request_finished`` / ``request_reset``: stop a load still landing (no byte of it lands
  afterwards) and give the lease back.

Worker (``worker.py``; every rank):

- ``start_load_kv``: asks the producers to push; records failures, never raises (except
  ``stop_on_failure``: a failed load on an engine that would publish its pages).
- ``wait_for_layer_load(i)``: synchronous loads wait (bounded) for layer i's pages; a
  request of this pass whose load failed raises ``KvLoadFailedError`` naming it, or, where
  the runtime takes them, is reported through ``take_failed_load_requests``.
- ``get_finished``: each handed-in asynchronous load once it is over (failed ones too,
  recorded as above); its lease goes back then, whether or not ``request_finished`` follows
  (a cancelled request gets none).

A load's life (``loads``: its states, transitions and what bounds each wait): CLAIMED ->
PLANNED -> DISPATCHED -> LANDED, or FAILED / ABANDONED (its transfer aborted first), then
settled (lease released). Every wait has a deadline (``consumer.load_timeout_s``);
``consumer.load_mode: auto`` loads asynchronously only where the runtime keeps a cancelled
request's pages while its load is pending. TP and prefix reservations:
docs/design/consumer.md.
"""

from __future__ import annotations

from .metadata import ConsumerMeta, KvLoadFailedError, LoadPlan, PrefixPlan, loads_async
from .scheduler import ConsumerScheduler
from .worker import ConsumerWorker

__all__ = [
    "ConsumerMeta",
    "ConsumerScheduler",
    "ConsumerWorker",
    "KvLoadFailedError",
    "LoadPlan",
    "PrefixPlan",
    "loads_async",
]
