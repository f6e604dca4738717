"""Protocol version and size limits shared by every message on every socket."""

from __future__ import annotations

# Bump on any incompatible change to a message's fields or meaning. Peers refuse frames
# whose `v` differs (ErrorCode.BAD_VERSION); there is no cross-version negotiation.
# 2: Lookup/Claim carry their keys packed in one bin (KeyBlob), not a list.
# 3: a receiver's data-plane capabilities travel typed (``DataCaps`` in Hello and Push),
#    never in its endpoint address.
# 4: keys no longer depend on the TP shard where both roles state the model's KV head
#    count (``Fingerprint.num_kv_heads``); ``Push`` names the KV heads to move
#    (``heads``) and where they land (``group_base``): producer and consumer may run
#    different TP sizes.
# Compatible additions do not bump it: a new optional field (ignored by older peers, so
# never one that changes what an older peer would do with the message), or a new message
# kind announced by name in ``HelloOk.features`` (an older peer refuses the kind itself
# by name, UNKNOWN_KIND, and announces no feature). Added so: ``release_range``
# (``ReleaseRange``: release part of a lease, for TensorRT-LLM's prefix reservations).
PROTOCOL_VERSION = 4

# Largest control frame decode() accepts by default. Callers that expect big replies
# (a SnapshotOk listing many keys) pass a larger `max_bytes`.
MAX_CONTROL_FRAME = 4 * 1024 * 1024

# Hard caps checked while decoding, so a hostile frame cannot make us allocate much.
MAX_KEYS = 1 << 20
MAX_GROUPS = 1024
MAX_STR = 4096
# A data plane's connection metadata in DataCaps (a NIXL agent's: its worker address and
# memory keys, ~0.5 KiB on one host, a few KiB with InfiniBand devices).
MAX_DATA_META = 1 << 20
