"""``disagg.bench.ports.free_port``: ports for processes about to start are picked below
the kernel's ephemeral range, so a socket bound to port 0 elsewhere never takes one."""

from __future__ import annotations

import socket

from disagg.bench import ports


def test_picked_ports_lie_below_the_ephemeral_range_and_are_never_handed_twice():
    low = ports._ephemeral_low()
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == 50
    assert all(ports._LOW <= p < low for p in picked)
    base = ports.free_port(3)
    assert base + 3 <= low and not set(range(base, base + 3)) & set(picked)
    for p in range(base, base + 3):  # each one is free to bind
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_bound_to_port_zero_is_never_picked():
    """Sockets bound to port 0 take theirs from the ephemeral range: none of them is a
    port the picker could hand out."""
    held = []
    try:
        for _ in range(20):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert all(p >= ports._ephemeral_low() for p in taken)
        assert not taken & {ports.free_port() for _ in range(20)}
    finally:
        for s in held:
            s.close()
