"""Free TCP ports for the servers tests start (workers' web ports, private brokers, gloo stores).

Every test server takes a port the kernel hands out (bind ``127.0.0.1:0``) instead of a fixed
number, so tests never collide with each other, with a leftover process of an earlier run, or
with anything else on the host.  The embedded stack's own ports (19092, 18123, 19000) are product
configuration, not test servers, and are not chosen here.
"""

from __future__ import annotations

import contextlib
import random
import socket


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all held open while choosing, so no two are the same)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def free_port_range(n: int, attempts: int = 100) -> int:
    """The first of ``n`` consecutive free ports, for configs that take a port base and count up
    (``port_base + k`` for the k-th launch)."""
    for _ in range(attempts):
        base = free_port()
        if base + n <= 65536 and _bindable(base, n):
            return base
    raise RuntimeError(f"no {n} consecutive free TCP ports found in {attempts} attempts")


def free_port_block(n: int) -> int:
    """The first of ``n`` consecutive ports below the kernel's ephemeral range (32768+) that can be
    bound now: ports from the ephemeral range may be taken by any outgoing connection before the
    daemons bind them (seen: a slurmd failing with "Address already in use" on a busy host)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 32_000 - n)
        if _bindable(base, n):
            return base
    raise AssertionError(f"no {n} consecutive free ports found")


def _bindable(base: int, n: int) -> bool:
    """Whether ports ``base`` .. ``base + n - 1`` can all be bound on 127.0.0.1 right now."""
    try:
        with contextlib.ExitStack() as stack:
            for port in range(base, base + n):
                stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
    except OSError:
        return False
    return True
