"""Producer role (prefill instances): save completed KV pages, index them, serve them.

Load with ``connector_module: disagg.producer``, ``ProducerScheduler`` / ``ProducerWorker``.
"""

from .connector import ProducerMeta, ProducerScheduler, ProducerWorker, SaveOp

__all__ = ["ProducerMeta", "ProducerScheduler", "ProducerWorker", "SaveOp"]
