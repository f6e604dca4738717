"""Protocol version and size limits shared by every message on every socket."""

from __future__ import annotations

# Bump on any incompatible change to a message's fields or meaning. Peers refuse frames
# whose `v` differs (ErrorCode.BAD_VERSION); there is no cross-version negotiation.
# 2: Lookup/Claim carry their keys packed in one bin (KeyBlob), not a list.
PROTOCOL_VERSION = 2

# Largest control frame decode() accepts by default. Callers that expect big replies
# (a SnapshotOk listing many keys) pass a larger `max_bytes`.
MAX_CONTROL_FRAME = 4 * 1024 * 1024

# Hard caps checked while decoding, so a hostile frame cannot make us allocate much.
MAX_KEYS = 1 << 20
MAX_GROUPS = 1024
MAX_STR = 4096
