"""Two nodes for real: the producer in network namespace A, the consumer in namespace B,
the proxy in the root namespace; a completion end to end equals the monolithic run.

Topology (three veth pairs, addresses in 10.213.0.0/16, no default route anywhere, so no
traffic can leave the namespaces this test makes)::

    root ──(10.213.{r}.1 / .2)── A [producer]
    root ──(10.213.{s}.1 / .2)── B [consumer]
    A    ──(10.213.{t}.1 / .2)── B   control plane, events and page pushes

The proxy reaches the producer's and consumer's HTTP servers over the root links and
subscribes to the producer's event stream; the producer and consumer talk over A-B only.
Needs root and `ip netns`; skipped otherwise (with the reason).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "serve"))
import serve_procs as sp  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def _netns_usable() -> str | None:
    """None when usable, else why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` command"
    probe = f"dgp{uuid.uuid4().hex[:8]}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` does not work here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _free_subnets(n: int) -> list[int]:
    used = _ip("-4", "addr").stdout + _ip("-4", "route").stdout
    candidates = [x for x in range(10, 250) if f"10.213.{x}." not in used]
    return random.sample(candidates, n)


@pytest.fixture
def namespaces():
    why = _netns_usable()
    if why:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"dg{tag}A", f"dg{tag}B"
    r, s, t = _free_subnets(3)
    root_links = [f"dg{tag}ra", f"dg{tag}rb"]
    try:
        _ip("netns", "add", ns_a)
        _ip("netns", "add", ns_b)
        links = [
            # (root-side or A-side name, its ns, address), (peer name, its ns, address)
            ((root_links[0], None, f"10.213.{r}.1/24"), (f"dg{tag}ar", ns_a, f"10.213.{r}.2/24")),
            ((root_links[1], None, f"10.213.{s}.1/24"), (f"dg{tag}br", ns_b, f"10.213.{s}.2/24")),
            ((f"dg{tag}ab", ns_a, f"10.213.{t}.1/24"), (f"dg{tag}ba", ns_b, f"10.213.{t}.2/24")),
        ]
        for (n1, ns1, a1), (n2, ns2, a2) in links:
            _ip("link", "add", n1, "type", "veth", "peer", "name", n2)
            for name, ns, addr in ((n1, ns1, a1), (n2, ns2, a2)):
                pre = ["-n", ns] if ns else []
                if ns:
                    _ip("link", "set", name, "netns", ns)
                _ip(*pre, "addr", "add", addr, "dev", name)
                _ip(*pre, "link", "set", name, "up")
        for ns in (ns_a, ns_b):
            _ip("-n", ns, "link", "set", "lo", "up")
        yield {
            "ns_a": ns_a,
            "ns_b": ns_b,
            "producer_root": f"10.213.{r}.2",
            "consumer_root": f"10.213.{s}.2",
            "producer_link": f"10.213.{t}.1",
            "consumer_link": f"10.213.{t}.2",
        }
    finally:
        for ns in (ns_a, ns_b):
            _ip("netns", "del", ns, check=False)  # removes the veths inside and their peers
        for name in root_links:
            _ip("link", "del", name, check=False)


def test_two_namespaces_end_to_end(namespaces: dict[str, str], tmp_path: Path) -> None:
    n = namespaces
    # Fixed ports are fine: each namespace has its own port space.
    cport, eport, dport, http = 25557, 25558, 25560, 28000
    pcfg = tmp_path / "producer.yaml"
    pcfg.write_text(
        "role: producer\ninstance_id: prefill-ns\nproducer:\n"
        f"  control: tcp://{n['producer_link']}:{cport}\n"
        f"  events: tcp://0.0.0.0:{eport}\n"  # the proxy reaches it over the root link
        "  store_size: 256MiB\n"
    )
    ccfg = tmp_path / "consumer.yaml"
    ccfg.write_text(
        "role: consumer\ninstance_id: decode-ns\nconsumer:\n"
        f"  producers: [tcp://{n['producer_link']}:{cport}]\n"
        f"  data: tcp://{n['consumer_link']}:{dport}\n"
    )
    producer_url = f"http://{n['producer_root']}:{http}"
    consumer_url = f"http://{n['consumer_root']}:{http}"
    pport = sp.free_port()
    proxy_url = f"http://127.0.0.1:{pport}"
    logs = {k: tmp_path / f"{k}.log" for k in ("producer", "consumer", "proxy")}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(
            sp.spawn(
                sp.serve_args("producer", pcfg, "0.0.0.0", http),
                logs["producer"],
                prefix=["ip", "netns", "exec", n["ns_a"]],
            )
        )
        procs.append(
            sp.spawn(
                sp.serve_args("consumer", ccfg, "0.0.0.0", http),
                logs["consumer"],
                prefix=["ip", "netns", "exec", n["ns_b"]],
            )
        )
        procs.append(
            sp.spawn(
                [
                    "proxy",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(pport),
                    "--producers",
                    producer_url,
                    "--consumers",
                    consumer_url,
                ],
                logs["proxy"],
            )
        )
        for url, proc, log in zip((producer_url, consumer_url, proxy_url), procs, logs.values()):
            sp.wait_healthy(url, proc, log)

        tokens = sp.prompt(seed=21)
        want = sp.monolithic(tokens, 10)
        status, body = sp.post(f"{proxy_url}/v1/completions", {"prompt": tokens, "max_tokens": 10})
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want
        assert body["disagg"]["connector_matched_tokens"] == 288  # pages crossed A -> B
        status, events = sp.post(
            f"{proxy_url}/v1/completions", {"prompt": tokens, "max_tokens": 10, "stream": True}
        )
        assert status == 200 and sp.streamed_tokens(events) == want

        _, prod = sp.get(f"{producer_url}/metrics")
        _, cons = sp.get(f"{consumer_url}/metrics")
        assert sp.metric(prod, "disagg_producer_pages_pushed_total") > 0
        assert sp.metric(cons, "disagg_consumer_pages_loaded_total") > 0
        # A repeated prompt finds its prefix through the producer's event stream.
        sp.wait_prefix_route(proxy_url, tokens)
    finally:
        sp.stop(procs)
