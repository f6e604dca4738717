"""The producer's control-plane handler (server thread): handshake, then every request.

Order of checks for a request other than ``Hello`` (any failure refuses it by name and
touches nothing): the incarnation it names (STALE_INCARNATION: meant for a process that is
gone), the connection's Hello (UNAUTHENTICATED), with CURVE the key that said it, and the
owner it names. ``Hello`` checks the fingerprint and transport (INCOMPATIBLE_PEER: said at
warning level, rate-limited, naming the consumer, its address and key), binds
the connection to the owner and, for a TP=1 consumer naming a new incarnation of an owner
already known, frees the previous process's leases (it restarted).

A mixin of ``ProducerService``: it reads the service's store, lease table, events,
metrics and peers, and hands pushes to ``_push``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..protocol import messages as m
from ..protocol.errors import ErrorCode, ProtocolError
from ..protocol.fingerprint import check_compatible
from ..protocol.version import PROTOCOL_VERSION
from .parked import ParkedClaims, claim_ok
from .saving import reserve_layers

if TYPE_CHECKING:
    from ..transport.control import ControlServer
    from ..transport.dataplane import DataPlane
    from ..transport.events import EventPublisher
    from .leases import LeaseTable
    from .store import BlockStore

log = logging.getLogger("disagg.producer")

# message type -> its request counter ("control_Claim", ...), built once per type
_CONTROL_METRIC: dict[type, str] = {cls: f"control_{cls.__name__}" for cls in m.ALL_MESSAGES}


class ControlPlane:
    """``_handle(identity, msg)``: the ControlServer's handler."""

    if TYPE_CHECKING:
        metrics: Any
        config: Any
        fingerprint: Any
        name: str
        features: tuple[str, ...]
        incarnation: int
        store: BlockStore
        data: DataPlane | None
        leases: LeaseTable
        parked: ParkedClaims
        events: EventPublisher | None
        server: ControlServer | None
        _curve: Any
        _peers: dict[bytes, str]
        _owner_keys: dict[str, bytes]
        _owner_incarnations: dict[str, int]

        def _push(self, owner: str, msg: Any) -> Any: ...

    def _handle(self, identity: bytes, msg: Any) -> Any:
        kind = type(msg)
        self.metrics[_CONTROL_METRIC.get(kind) or f"control_{kind.__name__}"] += 1
        if isinstance(msg, m.Hello):
            return self._hello(identity, msg)
        m.check_incarnation(msg, self.incarnation)  # first: a restart is named as such
        owner = self._peers.get(identity)
        if owner is None:
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "say Hello before any other request")
        if self._curve is not None and self._caller_key() != self._owner_keys.get(owner):
            raise ProtocolError(
                ErrorCode.UNAUTHENTICATED,
                f"this connection's CURVE key is not the one that said Hello as {owner!r}",
            )
        if getattr(msg, "owner", owner) != owner:
            raise ProtocolError(
                ErrorCode.UNAUTHENTICATED,
                f"this connection said Hello as {owner!r}, not {msg.owner!r}",
            )
        if isinstance(msg, m.Claim):  # the hot path: first
            if msg.wait_s > 0:  # a prefetch's: answered once every key is held
                return self.parked.claim(owner, msg)
            # msg.keys is a KeyBlob (decode checked it): looked up packed, never copied
            lease = self.leases.grant(owner, msg.request_id, msg.keys, msg.ttl_s)
            self.metrics["claims_hit" if lease else "claims_miss"] += 1
            return claim_ok(lease, msg.ttl_s, self.incarnation)
        if isinstance(msg, m.Heartbeat):
            self.leases.heartbeat(owner)
            return m.Ok(v=PROTOCOL_VERSION)
        if isinstance(msg, m.Lookup):
            return m.LookupOk(v=PROTOCOL_VERSION, num_blocks=self.store.longest_prefix(msg.keys))
        if isinstance(msg, m.Renew):
            return m.RenewOk(v=PROTOCOL_VERSION, unknown=self.leases.renew(owner, msg.lease_ids))
        if isinstance(msg, m.Release):
            self.leases.release(owner, msg.lease_id)
            return m.Ok(v=PROTOCOL_VERSION)
        if isinstance(msg, m.ReleaseRange):
            self.leases.release_range(owner, msg.lease_id, msg.first_block, msg.num_blocks)
            return m.Ok(v=PROTOCOL_VERSION)
        if isinstance(msg, m.Push):
            return self._push(owner, msg)
        if isinstance(msg, m.SnapshotRequest):
            keys = self.store.keys()
            seq = self.events.seq if self.events is not None else 0
            return m.SnapshotOk(
                v=PROTOCOL_VERSION,
                producer=self.name,
                seq=seq,
                keys=keys,
                incarnation=self.incarnation,
            )
        raise ProtocolError(
            ErrorCode.UNKNOWN_KIND, f"a producer does not serve {type(msg).__name__}"
        )

    def _hello(self, identity: bytes, msg: Any) -> Any:
        if self.fingerprint is None:
            raise ProtocolError(
                ErrorCode.NOT_READY, "the producer has not registered its KV cache yet"
            )
        try:
            check_compatible(self.fingerprint, msg.fingerprint)
            if msg.transport != self.config.transport:
                raise ProtocolError(
                    ErrorCode.INCOMPATIBLE_PEER,
                    f"the consumer pushes over transport {msg.transport!r}, this producer over "
                    f"{self.config.transport!r}: set the same `transport:` on both sides",
                )
        except ProtocolError as exc:
            self.metrics["handshake_refused"] += 1
            if self.server is not None:  # said (rate-limited) with who it was, and counted
                self.server.refusals.refused(
                    "incompatible",
                    f"Hello of consumer {msg.instance_id!r}: {exc.message}",
                    address=self.server.peer_address,
                    key=self.server.peer_key,
                )
            raise
        if self._curve is not None:
            key = self._caller_key()
            if self._owner_keys.setdefault(msg.instance_id, key) != key:
                self.metrics["owner_key_mismatch"] += 1
                raise ProtocolError(
                    ErrorCode.UNAUTHENTICATED,
                    f"owner {msg.instance_id!r} is bound to another client key",
                )
        self._note_owner_incarnation(msg)
        self._peers[identity] = msg.instance_id
        self.leases.heartbeat(msg.instance_id)
        return m.HelloOk(
            v=PROTOCOL_VERSION,
            instance_id=self.name,
            fingerprint=self.fingerprint,
            data_endpoint="",
            transport=self.config.transport,
            features=list(self.features),
            incarnation=self.incarnation,
            data_caps=self.data.source_caps if self.data is not None else m.DataCaps(),
            reserves_at_layer=reserve_layers(),
        )

    def _note_owner_incarnation(self, msg: Any) -> None:
        """A TP=1 consumer's Hello from a new incarnation: the process that held the
        owner's leases is gone, so they are freed now (not at OWNER_DEAD_AFTER: the new
        process heartbeats under the same name) and its connections must say Hello again.
        TP > 1 consumers are skipped: their ranks are processes sharing one owner name."""
        owner, inc = msg.instance_id, msg.incarnation
        if not inc or msg.fingerprint.tp_size != 1:
            return
        before = self._owner_incarnations.get(owner)
        self._owner_incarnations[owner] = inc
        if before is None or before == inc:
            return
        self.metrics["owner_restarts"] += 1
        for ident in [i for i, o in self._peers.items() if o == owner]:
            del self._peers[ident]
        freed = self.leases.free_owner(owner)
        log.warning(
            "consumer %s restarted (incarnation %#x -> %#x): freed its %d lease(s)",
            owner,
            before,
            inc,
            freed,
        )

    def _caller_key(self) -> bytes:
        """The CURVE key of the peer whose request is being handled (server thread)."""
        key = self.server.peer_key if self.server is not None else None
        if key is None:  # CURVE is on, so ZAP always names the peer; refuse if it didn't
            raise ProtocolError(ErrorCode.UNAUTHENTICATED, "no authenticated CURVE key")
        return key
