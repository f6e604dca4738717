"""Pick a data plane by the config's ``transport`` name, and say what its abort proves."""

from __future__ import annotations

from .dataplane import DataPlane


def make_data_plane(
    transport: str,
    *,
    bind: str = "tcp://127.0.0.1:0",
    advertise_host: str | None = None,
    checksum: bool = False,
    ucx_channel: str | None = None,
    ucx_rma_readers: int | None = None,
    ipc_spin_us: int | None = None,
    nixl_backend: str | None = None,
    nixl_devices: str | None = None,
    nixl_error_handling: str | None = None,
) -> DataPlane:
    """``tcp`` (plain TCP / Unix stream sockets, always available), ``ucx`` (needs ``pip
    install disagg[ucx]``), ``ipc`` (producer and consumer on one host: the consumer
    copies from the producer's store) or ``nixl`` (needs ``pip install disagg[nixl]``:
    the consumer reads the producer's store with NIXL, RDMA where the fabric has it).

    ``advertise_host`` replaces a wildcard bind's host in the endpoint peers are told.
    ``checksum`` (config ``transport_checksum``): xxh3-64 over every tcp payload, checked
    by the receiver; only the tcp plane has it (ValueError for the others).
    ``ucx_channel`` (``tcp`` when None) and ``ucx_rma_readers`` (None: the plane's
    default) go to the UCX plane; ``ipc_spin_us`` (None: ``spin.default_spin_us()``) to
    the ipc plane; ``nixl_backend`` (None: UCX) and ``nixl_devices`` (None: every
    device the backend finds) and ``nixl_error_handling`` (None: peer) to the nixl plane, which has no address to bind (NIXL
    picks its own); ValueError for the others."""
    if checksum and transport != "tcp":
        raise ValueError(
            f"transport_checksum: only the tcp data plane checksums, not {transport!r}"
        )
    if (ucx_channel is not None or ucx_rma_readers is not None) and transport != "ucx":
        raise ValueError(
            f"ucx_channel / ucx_rma_readers: UCX data plane settings, not for {transport!r}"
        )
    if ipc_spin_us is not None and transport != "ipc":
        raise ValueError(f"ipc_spin_us: an ipc data plane setting, not for {transport!r}")
    nixl_set = (nixl_backend, nixl_devices, nixl_error_handling)
    if any(v is not None for v in nixl_set) and transport != "nixl":
        raise ValueError(
            "nixl_backend / nixl_devices / nixl_error_handling: nixl data plane settings, "
            f"not for {transport!r}"
        )
    advertise = None
    if advertise_host and bind.startswith("tcp://"):
        port = bind.rsplit(":", 1)[1]
        if port != "0":
            advertise = f"tcp://{advertise_host}:{port}"
    if transport == "tcp":
        from .tcp import TcpDataPlane

        return TcpDataPlane(bind, advertise=advertise, checksum=checksum)
    if transport == "ucx":
        try:
            from .ucx.plane import UcxDataPlane
        except ImportError as exc:
            raise RuntimeError(
                f"transport: 'ucx' needs the ucxx package ({exc}); install it with "
                "`pip install disagg[ucx]` or set transport: tcp"
            ) from exc
        return UcxDataPlane(
            bind,
            advertise=advertise,
            channel=ucx_channel or "tcp",
            rma_readers=ucx_rma_readers,
        )
    if transport == "ipc":
        from .ipc import IpcDataPlane

        return IpcDataPlane(bind, advertise=advertise, spin_us=ipc_spin_us)
    if transport == "nixl":
        from .nixl import agent

        try:
            agent.nixl_api()
        except ImportError as exc:  # names the extra to install
            raise RuntimeError(str(exc)) from None
        from .nixl.plane import NixlDataPlane

        return NixlDataPlane(
            backend=nixl_backend or "UCX",
            devices=nixl_devices,
            error_handling=nixl_error_handling or "peer",
        )
    from ..config import RENAMED_TRANSPORTS

    if transport in RENAMED_TRANSPORTS:
        raise ValueError(f"transport: {RENAMED_TRANSPORTS[transport]}")
    raise ValueError(
        f"transport: unknown data plane {transport!r}; use 'tcp', 'ucx', 'ipc' or 'nixl'"
    )


def abort_gap(transport: str, ucx_channel: str | None = None) -> str | None:
    """Why an ``abort`` of this plane may return with writes of the transfer still under
    way (None: it never does; the contract's "no byte lands after abort" holds whatever
    the peer does), read from the config before any plane exists; each plane states the
    same as ``DataPlane.abort_complete``. The consumer fences a load whose pages the
    engine handed to another request by aborting it, so asynchronous loads need a plane
    without a gap."""
    if transport == "ucx" and (ucx_channel or "tcp") != "tcp":
        return (
            f"ucx_channel: {ucx_channel}: UCX cannot cancel a receive it has matched, and "
            "only the tcp channel can sever a stalled producer, so an abort may leave "
            "writes landing"
        )
    if transport == "nixl":
        return "transport: nixl: NIXL cannot stop a read it has posted"
    return None
