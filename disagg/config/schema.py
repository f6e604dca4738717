"""The config schema: one frozen msgspec Struct per section, the only statement of it.

A field's annotation is its check (type, ``Meta`` range, ``Literal`` choices, or a parsed
type from :mod:`.values` such as :class:`~.values.Size`); its ``Meta(description=...)`` and
``examples`` are what ``docs/configuration.md`` (``disagg config reference``) and the error
messages say. Unknown keys are refused (``forbid_unknown_fields``). A section is checked
however it is built, from a file or by calling the class: ``__post_init__`` converts each
field through its annotation, then runs the section's rules between fields (``_check``).
"""

from __future__ import annotations

import functools
import os
import socket
import typing
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from ..tuning import Tuning
from .errors import FLOAT_MAX, convert, convert_field, err
from .values import (
    BindEndpoint,
    HostName,
    KeyRef,
    Producers,
    PublicKeyFile,
    SecretKeyFile,
    Size,
    StoreDeviceName,
    plain,
    public_key,
    read_curve_key,
    resolve_key_paths,
)

# The data planes `transport:` names, and the one used when it is not given.
Transport = Literal["tcp", "ucx", "ipc", "nixl"]
TRANSPORTS: tuple[str, ...] = typing.get_args(Transport)
DEFAULT_TRANSPORT: Transport = "tcp"
# Former `transport:` names, refused with what to write instead.
RENAMED_TRANSPORTS: dict[str, str] = {
    "zmq": "'zmq' was renamed; use 'tcp' (plain TCP/Unix stream sockets; control stays on ZMQ)",
}

Role = Literal["producer", "consumer"]
ROLES: tuple[str, ...] = typing.get_args(Role)
UcxChannel = Literal["tcp", "shm", "auto"]
UCX_CHANNELS: tuple[str, ...] = typing.get_args(UcxChannel)
# store_device also takes cuda:N (StoreDeviceName); these are the names without an index
STORE_DEVICES: tuple[str, ...] = ("cpu", "pinned", "cuda")
LoadMode = Literal["auto", "async", "sync"]
LOAD_MODES: tuple[str, ...] = typing.get_args(LoadMode)
LoadFailurePolicy = Literal["auto", "fail_request", "stop_instance"]
LOAD_FAILURE_POLICIES: tuple[str, ...] = typing.get_args(LoadFailurePolicy)

DEFAULT_HEARTBEAT_S = 5.0

Seconds = Annotated[float, Meta(gt=0, le=FLOAT_MAX, extra={"unit": "seconds"})]
Name = Annotated[str, Meta(pattern=r"\S")]  # not empty, not only blanks
# NIXL backends that move memory between hosts (the plane checks the build has it)
NixlBackend = Literal["UCX", "LIBFABRIC"]
NIXL_BACKENDS: tuple[str, ...] = typing.get_args(NixlBackend)
NixlDevices = Annotated[str, Meta(pattern=r"^[\w.:-]+(,[\w.:-]+)*$")]
NixlErrorHandling = Literal["peer", "none"]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {name: hints[name] for name in cls.__struct_fields__}  # type: ignore[attr-defined]


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A config section, checked however it is built (see the module docstring)."""

    at: ClassVar[tuple[str, ...]] = ()  # where the section sits in the file

    def __post_init__(self) -> None:
        cls = type(self)
        for name, hint in _hints(cls).items():
            value = getattr(self, name)
            new = plain(convert_field(value, hint, cls, name, cls.at))
            if new is not value:
                msgspec.structs.force_setattr(self, name, new)
        self._check()

    def _check(self) -> None:
        """Rules between fields (each field alone is checked by its annotation)."""

    def _set(self, name: str, value: Any) -> None:
        msgspec.structs.force_setattr(self, name, value)


class ProducerConfig(Section, frozen=True):
    """Section `producer` (role = producer): the prefill side's store, control socket and
    lease timing."""

    at: ClassVar[tuple[str, ...]] = ("producer",)

    store_size: Annotated[
        Size,
        Meta(description="byte budget of the block store", examples=["4GiB"]),
    ]
    control: Annotated[
        BindEndpoint,
        Meta(
            description="control socket (lookup/claim/push/release) consumers connect to; with "
            "TP=N, rank r binds the same host at port + r (ipc://path: ipc://path.r; port 0: "
            "any free port on every rank)"
        ),
    ] = BindEndpoint("tcp://127.0.0.1:0")
    events: (
        Annotated[
            BindEndpoint,
            Meta(
                description="stored/removed event stream (PUB) for routers and consumers; with "
                "TP > 1 only rank 0 publishes; null: off"
            ),
        ]
        | None
    ) = None
    advertise_host: (
        Annotated[
            Name,
            Meta(description="host name peers use to reach this instance when it binds a wildcard"),
        ]
        | None
    ) = None
    store_device: Annotated[
        StoreDeviceName,
        Meta(
            description="where the store's bytes live; cuda:N must be the GPU of the "
            "engine's KV cache"
        ),
    ] = StoreDeviceName("cpu")
    lease_ttl_s: Annotated[Seconds, Meta(description="lifetime of a lease without a renewal")] = (
        30.0
    )
    owner_dead_after_s: (
        Annotated[
            Seconds,
            Meta(
                description="a consumer silent this long is declared dead and its leases freed; "
                "null: 3 x the default heartbeat (15 s)"
            ),
        ]
        | None
    ) = None
    lease_max_hold_s: Annotated[
        Seconds,
        Meta(
            description="no lease outlives this, however often it is renewed: bounds blocks "
            "pinned by a consumer that is alive but never releases; at least lease_ttl_s"
        ),
    ] = 600.0
    save_timeout_s: Annotated[
        Seconds, Meta(description="a save still in flight after this fails")
    ] = 30.0
    push_timeout_s: Annotated[Seconds, Meta(description="a page push that takes longer fails")] = (
        30.0
    )

    def _check(self) -> None:
        if self.lease_max_hold_s < self.lease_ttl_s:
            raise err(
                "producer.lease_max_hold_s",
                f"{self.lease_max_hold_s} s is shorter than producer.lease_ttl_s "
                f"({self.lease_ttl_s} s): raise it (default 600) or lower lease_ttl_s",
            )
        if self.owner_dead_after_s is None:
            self._set("owner_dead_after_s", 3 * DEFAULT_HEARTBEAT_S)


class ConsumerConfig(Section, frozen=True):
    """Section `consumer` (role = consumer): the producers to ask, the data socket, and how
    loads run and fail."""

    at: ClassVar[tuple[str, ...]] = ("consumer",)

    producers: Annotated[
        Producers,
        Meta(
            description="the producers' control endpoints. With TP > 1, one entry per producer "
            "instance: its rank-0 endpoint (rank r is then at port + r; the producer runs the "
            "consumer's TP size), or a list of its ranks' endpoints in rank order "
            "([[tcp://p0:5557, tcp://p0:6001]]), whose length is the producer's TP size (it "
            "may differ from the consumer's)",
            examples=[["tcp://prefill-0:5557"]],
        ),
    ]
    data: Annotated[BindEndpoint, Meta(description="where producers push pages")] = BindEndpoint(
        "tcp://127.0.0.1:0"
    )
    advertise_host: (
        Annotated[
            Name,
            Meta(description="host name producers use to reach `data` when it binds a wildcard"),
        ]
        | None
    ) = None
    load_mode: Annotated[
        LoadMode,
        Meta(
            description="async: whole pages, completion through get_finished; sync: pages "
            "stream layer by layer and wait_for_layer_load(i) waits only for layer i; auto: "
            "async where the data plane's abort proves no byte lands afterwards (a load whose "
            "pages the engine hands to another request is fenced by aborting it), else sync "
            "(ucx_channel: shm or auto)"
        ),
    ] = "auto"
    on_load_failure: Annotated[
        LoadFailurePolicy,
        Meta(
            description="what a load that fails after its tokens were offered does. "
            "fail_request: that request ends with an error naming it. stop_instance: the engine "
            "stops (an error TensorRT-LLM treats as fatal). auto: stop_instance on the V1 KV "
            "cache manager (with block reuse it keeps a released request's unfilled pages for "
            "reuse), else fail_request"
        ),
    ] = "auto"
    claim_timeout_s: Annotated[
        Seconds,
        Meta(
            description="budget of a request's lookup and claim; a producer slower than this "
            "is a miss (the engine computes the prompt itself)"
        ),
    ] = 1.0
    load_timeout_s: Annotated[
        Seconds,
        Meta(description="a claimed load not landed by then fails the request"),
    ] = 30.0
    heartbeat_s: Annotated[
        Seconds, Meta(description="lease renewal period; shorter than lease_ttl_s")
    ] = DEFAULT_HEARTBEAT_S
    lease_ttl_s: Annotated[Seconds, Meta(description="lease lifetime requested from producers")] = (
        30.0
    )
    landing_zone_size: (
        Annotated[
            Size,
            Meta(
                description="byte budget of the landing zone: memory of this consumer that a "
                "prefetched prompt's pages are pushed into while the producer still "
                "prefills, copied into the engine's pages when the continuation comes "
                "(TP = 1); null: off (pushes start at the continuation)",
                examples=["1GiB"],
            ),
        ]
        | None
    ) = None
    landing_zone_device: (
        Annotated[
            StoreDeviceName,
            Meta(
                description="where the landing zone lives: cpu, pinned, cuda (the engine's "
                "GPU) or cuda:N; null: the engine's KV cache device"
            ),
        ]
        | None
    ) = None

    def _check(self) -> None:
        if self.landing_zone_device is not None and self.landing_zone_size is None:
            raise err(
                "consumer.landing_zone_device",
                "is set but consumer.landing_zone_size is not: set landing_zone_size "
                "(e.g. 1GiB) to turn the landing zone on, or drop landing_zone_device",
            )
        if self.heartbeat_s >= self.lease_ttl_s:
            raise err(
                "consumer.heartbeat_s",
                f"{self.heartbeat_s} s must be shorter than consumer.lease_ttl_s "
                f"({self.lease_ttl_s} s), or leases expire between heartbeats; "
                f"e.g. heartbeat_s = {self.lease_ttl_s / 6:g}",
            )


class SecurityConfig(Section, frozen=True):
    """Section `security` (optional): ZMQ CURVE on the control and event sockets, with keys
    from `disagg keys NAME --dir DIR`. Files must exist and hold a key; relative paths are
    resolved against the config file's directory."""

    at: ClassVar[tuple[str, ...]] = ("security",)

    curve_secret_key_file: (
        Annotated[SecretKeyFile, Meta(description="this instance's secret key file")] | None
    ) = None
    curve_public_key_file: (
        Annotated[
            PublicKeyFile,
            Meta(description="this instance's public key file (both key files or neither)"),
        ]
        | None
    ) = None
    server_public_key: (
        Annotated[
            KeyRef,
            Meta(description="consumer only, required with CURVE: the producers' public key"),
        ]
        | None
    ) = None
    allowed_client_keys: Annotated[
        tuple[KeyRef, ...],
        Meta(description="producer only: the consumers allowed to connect"),
    ] = ()

    def _check(self) -> None:
        if (self.curve_secret_key_file is None) != (self.curve_public_key_file is None):
            missing = (
                "curve_public_key_file"
                if self.curve_public_key_file is None
                else "curve_secret_key_file"
            )
            raise err(
                f"security.{missing}",
                "CURVE needs both curve_secret_key_file and curve_public_key_file "
                "(NAME.key and NAME.key.pub from `disagg keys`)",
            )
        if (self.server_public_key or self.allowed_client_keys) and not self.enabled:
            which = "server_public_key" if self.server_public_key else "allowed_client_keys"
            raise err(
                f"security.{which}",
                "is set but this instance has no key pair; set curve_secret_key_file and "
                "curve_public_key_file too",
            )

    @property
    def enabled(self) -> bool:
        return self.curve_secret_key_file is not None

    def secret_key(self) -> bytes:
        assert self.curve_secret_key_file is not None
        return read_curve_key(self.curve_secret_key_file, "secret")

    def public_key(self) -> bytes:
        assert self.curve_public_key_file is not None
        return read_curve_key(self.curve_public_key_file, "public")

    def server_key(self) -> bytes | None:
        return None if self.server_public_key is None else public_key(self.server_public_key)

    def client_keys(self) -> list[bytes]:
        return [public_key(k) for k in self.allowed_client_keys]


class MetricsConfig(Section, frozen=True):
    """Section `metrics`: the connector's own Prometheus endpoint (inside trtllm-serve there
    is no other /metrics to use)."""

    at: ClassVar[tuple[str, ...]] = ("metrics",)

    port: (
        Annotated[int, Meta(ge=0, le=65535, description="Prometheus /metrics port; null: off")]
        | None
    ) = None
    host: Annotated[
        HostName,
        Meta(
            description="address that port binds: 127.0.0.1 is this host only; 0.0.0.0 every "
            "interface (a container)"
        ),
    ] = HostName("127.0.0.1")


def _default_instance_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def _refuse_renamed(transport: Any) -> None:
    """A former ``transport:`` name is one error naming its new one."""
    if isinstance(transport, str) and transport in RENAMED_TRANSPORTS:
        raise err("transport", RENAMED_TRANSPORTS[transport])


class DisaggConfig(Section, frozen=True, dict=True):
    """The whole file. `producer` is set iff role = producer, `consumer` iff consumer."""

    role: Annotated[Role, Meta(description="which connector this instance runs")]
    instance_id: (
        Annotated[
            Name,
            Meta(
                description="identity in leases, logs and metrics; set it to something stable; "
                "null: `<role>-<hostname>-<pid>`"
            ),
        ]
        | None
    ) = None
    model_id: (
        Annotated[
            Name,
            Meta(
                description="overrides the source of the model fingerprint (must be equal on "
                "both sides)"
            ),
        ]
        | None
    ) = None
    num_kv_heads: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="the model's KV head count, every TP rank's together (the "
                "checkpoint's num_key_value_heads): pages move by KV head between producer "
                "and consumer TP sizes that differ only where it is known. Set it where the "
                "connector cannot read it from the engine (a TensorRT-LLM model given by hub "
                "name, not a local checkpoint); equal on both roles; null: from the engine's "
                "model config (the reference engine's, or the checkpoint's config.json)",
                examples=[8],
            ),
        ]
        | None
    ) = None
    tensor_parallel_size: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="this instance's TP size: `disagg serve` runs the reference engine "
                "with that many ranks in its process (as --tp) and passes it to trtllm-serve "
                "(--tp_size); a connector whose runtime runs another size refuses to start; "
                "null: the engine's",
                examples=[2],
            ),
        ]
        | None
    ) = None
    transport: Annotated[
        Transport,
        Meta(
            description="data plane for page pushes, the same on both sides. ipc: producer "
            "and consumer on one host; the consumer copies pages straight out of the "
            "producer's store (CUDA IPC for store_device: cuda, a /dev/shm file otherwise). "
            "nixl (pip install disagg[nixl]): the consumer reads the producer's store with "
            "NIXL: InfiniBand/RoCE RDMA (GPUDirect for device memory) across nodes"
        ),
    ] = DEFAULT_TRANSPORT
    transport_checksum: Annotated[
        bool,
        Meta(
            description="tcp only: xxh3-64 over every payload, checked by the consumer (a "
            "mismatch fails the transfer); used only when both sides set it"
        ),
    ] = False
    ucx_channel: (
        Annotated[
            UcxChannel,
            Meta(
                description="transport: ucx only; null: tcp. shm: producer and consumer on one "
                "host, the consumer reads the producer's store one-sided; the same on both sides"
            ),
        ]
        | None
    ) = None
    ucx_rma_readers: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="transport: ucx only: threads, each with its own UCX worker, that "
                "copy a shm consumer's one-sided reads; wins over tuning.ucx_rma_readers; null: "
                "that switch, else 2 on 2+ CPUs",
            ),
        ]
        | None
    ) = None
    ipc_spin_us: (
        Annotated[
            int,
            Meta(
                ge=0,
                description="transport: ipc only: microseconds the plane's threads spin (GIL "
                "released) for the next message before they sleep; 0 turns it off; wins over "
                "tuning.spin_us; null: that switch, else 2000 on 8+ CPUs, 0 below",
            ),
        ]
        | None
    ) = None
    nixl_backend: (
        Annotated[
            NixlBackend,
            Meta(
                description="transport: nixl only: the NIXL backend that moves pages; null: "
                "UCX (InfiniBand, RoCE, TCP, shared memory, cuda_ipc; the one tested here)",
                examples=["UCX"],
            ),
        ]
        | None
    ) = None
    nixl_devices: (
        Annotated[
            NixlDevices,
            Meta(
                description="transport: nixl only: the devices the backend may use, "
                "comma-separated (UCX: as UCX_NET_DEVICES, e.g. mlx5_0:1,mlx5_1:1; `ucx_info "
                "-d` lists them); null: every device it finds",
                examples=["mlx5_0:1"],
            ),
        ]
        | None
    ) = None
    nixl_error_handling: (
        Annotated[
            NixlErrorHandling,
            Meta(
                description="transport: nixl only, UCX backend: `peer` (null's choice) makes "
                "UCX report a dead peer as a failed read, and leaves out the lanes that cannot "
                "(shared memory, cuda_ipc: device memory then moves through host staging); "
                "`none` lets UCX use them (cuda_ipc: ~400x faster on one GPU) without UCX's "
                "keepalive: a killed producer still fails its reads (tested on one host), "
                "but a silent one (a host gone, a cut link) is found only by the transfer's "
                "deadline: opt-in for trusted peers on one node (docs/design/nixl-plane.md)",
                examples=["none"],
            ),
        ]
        | None
    ) = None
    producer: (
        Annotated[
            ProducerConfig, Meta(description="required when role: producer, refused otherwise")
        ]
        | None
    ) = None
    consumer: (
        Annotated[
            ConsumerConfig, Meta(description="required when role: consumer, refused otherwise")
        ]
        | None
    ) = None
    security: (
        Annotated[SecurityConfig, Meta(description="ZMQ CURVE on the control and event sockets")]
        | None
    ) = None
    metrics: Annotated[MetricsConfig, Meta(description="the connector's Prometheus endpoint")] = (
        msgspec.field(default_factory=MetricsConfig)
    )
    tuning: Annotated[
        Tuning,
        Meta(description="expert switches; each DISAGG_* variable overrides its own"),
    ] = msgspec.field(default_factory=Tuning)

    def __post_init__(self) -> None:
        _refuse_renamed(self.transport)  # before its field check words it as unknown
        super().__post_init__()

    def _check(self) -> None:
        if self.instance_id is None:
            self._set("instance_id", _default_instance_id(self.role))
        if self.transport_checksum and self.transport != "tcp":
            raise err(
                "transport_checksum",
                f"only the tcp data plane checksums payloads; transport is "
                f"'{self.transport}' (remove transport_checksum or set transport: tcp)",
            )
        for name, plane, what in (
            ("ucx_channel", "ucx", "a UCX"),
            ("ucx_rma_readers", "ucx", "a UCX"),
            ("ipc_spin_us", "ipc", "an ipc"),
            ("nixl_backend", "nixl", "a nixl"),
            ("nixl_devices", "nixl", "a nixl"),
            ("nixl_error_handling", "nixl", "a nixl"),
        ):
            if getattr(self, name) is not None and self.transport != plane:
                raise err(
                    name,
                    f"is {what} data plane setting; transport is '{self.transport}' "
                    f"(remove {name} or set transport: {plane})",
                )
        kv, tp = self.num_kv_heads, self.tensor_parallel_size
        if kv is not None and tp is not None and kv % tp and tp % kv:
            raise err(
                "tensor_parallel_size",
                f"{tp} neither divides num_kv_heads ({kv}) nor is a multiple of it: use a TP "
                "size that does (KV heads are sharded over the ranks)",
            )
        other = "consumer" if self.role == "producer" else "producer"
        if getattr(self, other) is not None:
            raise err(
                other,
                f"section given but role is '{self.role}'; remove it or set role: {other} "
                "(one file per instance)",
            )
        if self.role == "producer" and self.producer is None:
            raise err(
                "producer.store_size",
                "is required for role producer; add a producer: section with e.g. store_size: 4GiB",
            )
        if self.role == "consumer" and self.consumer is None:
            raise err(
                "consumer.producers",
                "is required for role consumer; add a consumer: section with e.g. "
                "producers: [tcp://prefill-0:5557]",
            )
        sec = self.security
        if sec is not None and self.role == "producer" and sec.server_public_key is not None:
            raise err(
                "security.server_public_key",
                "is a consumer setting; a producer lists allowed_client_keys instead",
            )
        if sec is not None and self.role == "consumer" and sec.allowed_client_keys:
            raise err(
                "security.allowed_client_keys",
                "is a producer setting; a consumer sets server_public_key instead",
            )
        if sec is not None and self.role == "consumer" and sec.enabled:
            if sec.server_public_key is None:
                raise err(
                    "security.server_public_key",
                    "is required when a consumer uses CURVE; set it to the producers' "
                    "public key (Z85 or NAME.key.pub)",
                )

    # ---- construction from data

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        base_dir: str | os.PathLike[str] | None = None,
        source: str | None = None,
    ) -> DisaggConfig:
        """Build and validate from a parsed mapping. Relative key-file paths are resolved
        against ``base_dir`` (the config file's directory when loaded from a file)."""
        if base_dir is not None and isinstance(data, Mapping):
            if isinstance(data.get("security"), Mapping):
                data = {**data, "security": resolve_key_paths(dict(data["security"]), base_dir)}
        if isinstance(data, Mapping):
            _refuse_renamed(data.get("transport"))
        cfg: DisaggConfig = convert(data, cls)
        cfg.__dict__["source"] = source
        return cfg

    def __reduce__(self) -> tuple[Any, ...]:  # a pickled copy keeps its source
        return (_restore, (msgspec.structs.asdict(self), self.source))

    @property
    def source(self) -> str | None:
        """The file this config was loaded from (not part of the config: equal configs from
        two files compare equal)."""
        return self.__dict__.get("source")

    def to_dict(self) -> dict[str, Any]:
        """Normalised plain data (sizes in bytes, endpoints canonical, defaults filled in);
        ``from_dict(to_dict())`` gives an equal config. Unused sections are left out."""
        data = _lists(msgspec.to_builtins(self))
        names = ["role", "instance_id", "model_id"]
        names += [n for n in ("num_kv_heads", "tensor_parallel_size") if data[n] is not None]
        names += ["transport", "transport_checksum"]
        if self.transport == "ucx":
            names += ["ucx_channel", "ucx_rma_readers"]
        if self.transport == "ipc":
            names.append("ipc_spin_us")
        if self.transport == "nixl":
            names += ["nixl_backend", "nixl_devices", "nixl_error_handling"]
        names += [n for n in ("producer", "consumer", "security", "metrics") if data[n]]
        names += ["tuning"] if data["tuning"] else []  # only the switches set
        return {name: data[name] for name in names}

    @property
    def section(self) -> ProducerConfig | ConsumerConfig:
        """The role's own section."""
        sec = self.producer if self.role == "producer" else self.consumer
        assert sec is not None
        return sec


def _restore(fields: dict[str, Any], source: str | None) -> DisaggConfig:
    cfg = DisaggConfig(**fields)
    cfg.__dict__["source"] = source
    return cfg


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    return value
