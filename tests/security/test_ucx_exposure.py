"""UCX's tcp transport takes one-sided writes at any address of a process from any peer
that reaches its sockets (docs/design/security.md). The
UCX plane keeps tcp off every network it was not asked to serve (``exposure_config``):
``shm`` planes load no tcp transport, ``tcp`` planes only on their bind address's device.

The hostile peer is a small C program (``ucx_forged_put.c``) built against the libucp that
ucxx loads; the remote host is a network namespace (root and ``ip netns``: skipped
otherwise, with the reason)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import torch

pytest.importorskip("ucxx")

from disagg import hostmem  # noqa: E402
from disagg.transport.ucx.plane import UcxDataPlane  # noqa: E402
from disagg.transport.ucx.settings import (  # noqa: E402
    TCP_HARDENING,
    TCP_TUNING,
)
from disagg.transport.ucx.settings import exposure_config as _exposure_config  # noqa: E402
from disagg.transport.ucx.settings import net_device as _net_device  # noqa: E402

pytestmark = pytest.mark.timeout(120)
MARK = 0xDEADBEEFCAFEF00D
HERE = Path(__file__).parent


def _listening(pid_fds: str = "/proc/self/fd") -> list[tuple[str, int]]:
    """(IPv4 address, port) of every TCP socket of this process in LISTEN state."""
    inodes = set()
    for fd in os.listdir(pid_fds):
        try:
            link = os.readlink(f"{pid_fds}/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                ip_hex, port_hex = cols[1].split(":")
                ip = ".".join(str(b) for b in reversed(bytes.fromhex(ip_hex)))
                out.append((ip, int(port_hex, 16)))
    return out


def _port(endpoint: str) -> int:
    port = urlparse(endpoint.replace("ucx+tcp", "tcp")).port
    assert port is not None
    return port


def test_exposure_settings(monkeypatch):
    for k in ("UCX_TLS", "UCX_NET_DEVICES", *(f"UCX_{k}" for k in {**TCP_HARDENING, **TCP_TUNING})):
        monkeypatch.delenv(k, raising=False)
    assert _net_device("127.0.0.1") == "lo" and _net_device("localhost") == "lo"
    assert _net_device("0.0.0.0") is None and _net_device("*") is None
    put = {"RNDV_SCHEME": "put_zcopy"}
    assert _exposure_config("shm", None) == {"TLS": "^tcp", **put}
    tcp = {**TCP_HARDENING, **TCP_TUNING}
    assert _exposure_config("tcp", "127.0.0.1") == {"NET_DEVICES": "lo", **tcp}
    assert _exposure_config("tcp", "0.0.0.0") == tcp
    assert TCP_HARDENING["TCP_PUT_ENABLE"] == "n" and TCP_HARDENING["RNDV_SCHEME"] == "am"
    # same-host channels keep the put rendezvous (cma, cuda_ipc) and auto UCX's transports
    assert _exposure_config("auto", None) == put


def test_operator_settings_win(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp,sm")
    monkeypatch.setenv("UCX_NET_DEVICES", "eth0")
    for k in TCP_HARDENING:
        monkeypatch.delenv(f"UCX_{k}", raising=False)
    monkeypatch.setenv("UCX_TCP_MAX_IOV", "16")
    assert _exposure_config("shm", None) == {"RNDV_SCHEME": "put_zcopy"}
    assert _exposure_config("tcp", "127.0.0.1") == TCP_HARDENING


@pytest.mark.parametrize(
    "env",
    [
        {"UCX_TCP_PUT_ENABLE": "y"},
        {"UCX_RNDV_SCHEME": "get_zcopy"},
        {"UCX_TCP_RX_SEG_SIZE": "64k"},
    ],
)
def test_an_operator_protocol_setting_turns_all_of_ours_off(monkeypatch, env):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.delenv("UCX_TCP_MAX_IOV", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _exposure_config("tcp", "127.0.0.1") == {"NET_DEVICES": "lo", **TCP_TUNING}
    assert _exposure_config("shm", None) == {"TLS": "^tcp"}


def test_shm_plane_listens_on_no_tcp_socket_and_tcp_plane_on_loopback_only():
    """Under UCX's defaults a shm plane's worker would listen on tcp on every device
    (here eth0 and lo), and a tcp plane's likewise, whatever its bind address."""
    before = set(_listening())
    plane = UcxDataPlane(channel="shm")
    try:
        assert set(_listening()) - before == set()
    finally:
        plane.close()
    plane = UcxDataPlane(channel="tcp")  # bind tcp://127.0.0.1:0
    try:
        new = set(_listening()) - before
        cm = _port(plane.endpoint)
        # ucxx 0.52 binds its connection listener to every address (no host argument);
        # a peer that connects through it finds no tcp transport to reach (next test)
        assert ("0.0.0.0", cm) in new
        assert all(ip == "127.0.0.1" for ip, port in new if port != cm), new
    finally:
        plane.close()


def _netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` command"
    if shutil.which("gcc") is None:
        return "needs gcc to build the hostile peer"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture(scope="module")
def attacker(tmp_path_factory):
    """The hostile peer's binary and a namespace one veth hop away: (binary, ns, our IP)."""
    why = _netns_usable()
    if why:
        pytest.skip(why)
    import libucx

    ucx = Path(libucx.__file__).parent
    out = tmp_path_factory.mktemp("ucxput") / "ucx_forged_put"
    subprocess.run(
        ["gcc", "-O1", "-o", str(out), str(HERE / "ucx_forged_put.c"), f"-I{ucx / 'include'}",
         f"-L{ucx / 'lib'}", "-lucp", "-lucs", f"-Wl,-rpath,{ucx / 'lib'}"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    tag = uuid.uuid4().hex[:6]
    ns, ours, theirs = f"dgx{tag}", f"dgx{tag}r", f"dgx{tag}n"
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
    net = next(x for x in range(10, 250) if f"10.214.{x}." not in used)
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", ours, "type", "veth", "peer", "name", theirs)
        _ip("link", "set", theirs, "netns", ns)
        _ip("addr", "add", f"10.214.{net}.1/24", "dev", ours)
        _ip("link", "set", ours, "up")
        _ip("-n", ns, "addr", "add", f"10.214.{net}.2/24", "dev", theirs)
        _ip("-n", ns, "link", "set", theirs, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield out, ns, f"10.214.{net}.1"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", ours], capture_output=True, timeout=20)


def _attack(attacker, monkeypatch, **ucx_env: str) -> tuple[bool, str]:
    """A tcp consumer (bind 127.0.0.1, its defaults but for ``ucx_env``: the operator's
    UCX settings) with a page pool; the hostile peer, on another host, puts into slot
    5, and afterwards a real push still lands. (written?, the peer's last words)"""
    binary, ns, our_ip = attacker
    for k, v in ucx_env.items():
        monkeypatch.setenv(k, v)
    plane = UcxDataPlane(channel="tcp")
    try:
        pool = hostmem.empty((16, 4096))
        pool.fill_(0)
        plane.register_regions([[pool]])
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
        r = subprocess.run(
            ["ip", "netns", "exec", ns, str(binary), our_ip, str(_port(plane.endpoint)),
             hex(pool.data_ptr() + 5 * 4096)],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        time.sleep(0.3)  # a put the peer saw flushed has landed; give a late one time
        hit = bool((pool.numpy()[5, :64].copy().view(np.uint64) == MARK).all())
        untouched = not pool.numpy()[:5].any() and not pool.numpy()[6:].any()
        assert untouched
        # the consumer still serves: a real push lands byte-exact
        pages = torch.randint(0, 256, (4, 4096), dtype=torch.uint8)
        plane.expect(9, 1, b"tok", [4], 20.0, [[8, 9, 10, 11]])
        tx = UcxDataPlane(channel="tcp")
        try:
            dst = [8, 9, 10, 11]
            h = tx.post_push(
                plane.endpoint, 9, 1, b"tok", [(0, pages, dst)], 30, plane.capabilities
            )
            assert tx.wait_push(h, 20).done and plane.wait(9, 20).done
        finally:
            tx.close()
        assert torch.equal(torch.from_numpy(pool.numpy()[8:12]), pages)
        return hit, r.stderr.strip()[-300:]
    finally:
        plane.close()


@pytest.mark.netns
def test_a_forged_put_from_another_host_is_refused(attacker, monkeypatch):
    hit, said = _attack(attacker, monkeypatch)
    assert not hit, f"a forged put from another host landed in the consumer's pool ({said})"


# The operator's form of the hardening (docs/design/security.md): the settings a tcp
# plane takes by default (TCP_HARDENING), given in the environment
HARDENED = {f"UCX_{k}": v for k, v in TCP_HARDENING.items()}


@pytest.mark.netns
def test_the_default_tcp_plane_refuses_the_put_even_with_tcp_on_every_device(attacker, monkeypatch):
    """Only ``UCX_NET_DEVICES=all`` from the operator: the plane's own protocol settings
    (TCP_HARDENING) still refuse the peer's put."""
    hit, said = _attack(attacker, monkeypatch, UCX_NET_DEVICES="all")
    assert not hit, f"a forged put landed in a default tcp plane ({said})"


@pytest.mark.netns
def test_hardened_settings_refuse_the_put_even_with_tcp_on_every_device(attacker, monkeypatch):
    hit, said = _attack(attacker, monkeypatch, UCX_NET_DEVICES="all", **HARDENED)
    assert not hit, f"a forged put landed with the hardened settings ({said})"


@pytest.mark.netns
def test_the_forged_put_is_real_when_tcp_serves_every_device(attacker, monkeypatch):
    """The control: UCX's tcp on every device with its put on (UCX's own defaults, given
    by an operator as ``UCX_NET_DEVICES=all UCX_TCP_PUT_ENABLE=y``) lets the same peer
    write the consumer's memory."""
    hit, said = _attack(attacker, monkeypatch, UCX_NET_DEVICES="all", UCX_TCP_PUT_ENABLE="y")
    assert hit, f"the control attack did not land: {said}"
