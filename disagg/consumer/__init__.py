"""Consumer role (decode instances): claim remote prefixes, load them into our page slots.

Load with ``connector_module: disagg.consumer``, ``ConsumerScheduler`` / ``ConsumerWorker``.
"""

from .connector import ConsumerMeta, ConsumerScheduler, ConsumerWorker, KvLoadFailedError

__all__ = ["ConsumerMeta", "ConsumerScheduler", "ConsumerWorker", "KvLoadFailedError"]
