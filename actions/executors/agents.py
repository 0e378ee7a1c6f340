"""The warm path of an executor's restart (issue #37 item 2): through the job's node agents
(:mod:`trainguard.agent`) when every one is warm, else the executor's cold path.

Pure decisions (:func:`warm_verdict`, :func:`next_world`, :func:`agent_urls`) plus the two network
calls an executor makes (:func:`probe`, :func:`send_restarts`: every agent at once, so a 64-node
job pays one round trip, not 64).  The recipe is the one in docs/guides/warm-agent.md: ask each
agent's state, take the next generation, the new node order with a replacement in the evicted
machine's place, a fresh ``MASTER_PORT`` and ``MASTER_ADDR`` = the first node, then send every
agent of the old and new node lists its signed ``agent_restart``.

>>> p = [AgentProbe("n1", "http://a:9403", True, {"state": "running", "generation": 3}),
...      AgentProbe("n2", "http://b:9403", True, {"state": "warm", "generation": 3})]
>>> warm_verdict(p, ["n1", "n2"])
''
>>> w = next_world(p, ["n2", "n1"], {"n1": "a", "n2": "b"}, (29600, 29700))
>>> w.generation, w.nodes, w.master_addr, w.master_port
(4, ('n2', 'n1'), 'b', 29604)
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from trainguard.infra import agent_client
from trainguard.infra.signing import Signer

log = logging.getLogger(__name__)

#: agent states from which a restart command is taken at once.
READY = ("running", "warm")


@dataclass(frozen=True)
class AgentProbe:
    """One agent's answer to ``GET /state`` (``doc`` empty when it did not answer)."""

    node: str
    url: str
    warm: bool
    doc: dict[str, Any]

    @property
    def generation(self) -> int:
        gen = self.doc.get("generation", 0)
        return gen if isinstance(gen, int) and not isinstance(gen, bool) else 0


class WarmWorld(NamedTuple):
    """What every agent is told: the generation and the world of the restarted ranks."""

    generation: int
    nodes: tuple[str, ...]
    master_addr: str
    master_port: int


def agent_urls(
    nodes: list[str], addrs: dict[str, str], ports: dict[str, int], port: int, per_node: int
) -> dict[str, list[str]]:
    """Each node's agent URLs: ``per_node`` agents at ``port`` + local rank (``trainguard launch
    --agent``: one agent per rank), the node's own base port in ``ports`` when it has one (several
    slurmd on one host, as the local stack runs them, share an address).

    >>> agent_urls(["n1", "n2"], {"n1": "10.0.0.1", "n2": "10.0.0.2"}, {"n2": 9500}, 9403, 2)
    {'n1': ['http://10.0.0.1:9403', 'http://10.0.0.1:9404'], 'n2': ['http://10.0.0.2:9500', 'http://10.0.0.2:9501']}
    """
    out = {}
    for n in nodes:
        base = ports.get(n, port)
        out[n] = [f"http://{addrs.get(n) or n}:{base + i}" for i in range(per_node)]
    return out


def probe(urls: dict[str, list[str]], timeout_s: float) -> list[AgentProbe]:
    """``GET /state`` of every agent, all at once; one that does not answer is not warm."""
    pairs = [(n, u) for n, us in urls.items() for u in us]
    if not pairs:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(pairs))) as pool:
        answers = list(pool.map(lambda nu: agent_client.state(nu[1], timeout_s), pairs))
    return [AgentProbe(n, u, warm, doc) for (n, u), (warm, doc) in zip(pairs, answers, strict=True)]


def warm_verdict(probes: list[AgentProbe], nodes: list[str]) -> str:
    """ "" when the warm path is there (every node of ``nodes`` has agents, each warm and
    running or warm), else why not -- the reason the cold path is taken, for the log.

    >>> warm_verdict([AgentProbe("n1", "http://a:9403", False, {})], ["n1", "n2"])
    'no agent configured on n2; http://a:9403 (n1) does not answer'
    """
    why = [f"no agent configured on {n}" for n in nodes if not any(p.node == n for p in probes)]
    for p in probes:
        if not p.doc:
            why.append(f"{p.url} ({p.node}) does not answer")
        elif not p.warm or p.doc.get("state") not in READY:
            err = (p.doc.get("zygote") or {}).get("error", "")
            why.append(f"{p.url} ({p.node}) is {p.doc.get('state', '?')}{', ' + err if err else ''}")
    return "; ".join(why)


def next_world(
    probes: list[AgentProbe], nodes: list[str], addrs: dict[str, str], ports: tuple[int, int]
) -> WarmWorld:
    """The world after this restart: one generation above any agent's, ``nodes`` in rank order
    (the caller's spec order: a replacement in the evicted machine's place), ``MASTER_ADDR`` the
    first node's address and a ``MASTER_PORT`` of the generation in ``ports`` -- fresh, so a
    stale rank of the old world that still connects finds no rendezvous; the same for a re-sent
    command of the same generation."""
    gen = max((p.generation for p in probes), default=0) + 1
    lo, hi = ports
    port = lo + gen % max(1, hi - lo)
    first = nodes[0] if nodes else ""
    addr = addrs.get(first) or first or "127.0.0.1"
    return WarmWorld(gen, tuple(nodes), addr, port)


def send_restarts(
    job: str,
    world: WarmWorld,
    probes: list[AgentProbe],
    signer: Signer,
    timeout_s: float,
    code_version: str = "",
) -> list[str]:
    """Send each probed agent its signed ``agent_restart``, all at once; what went wrong (empty:
    every agent answered 200 ``done``).  An agent that times out or refuses is named; the caller
    then takes the cold path, which stops whatever the others started."""

    def one(p: AgentProbe) -> str:
        nodes, addr, port = list(world.nodes), world.master_addr, world.master_port
        cmd = agent_client.restart_command(job, p.node, world.generation, nodes, addr, port, code_version)
        try:
            status, reply = agent_client.send(p.url, cmd, signer, timeout_s=timeout_s)
        except (OSError, ValueError) as exc:  # timeout, connection refused, a garbled reply
            return f"{p.url} ({p.node}): {exc}"
        if status != 200 or reply.get("outcome") != "done":
            return f"{p.url} ({p.node}): HTTP {status} {reply.get('outcome', '')} {reply.get('detail', '')}"
        return ""

    if not probes:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(probes))) as pool:
        return [f for f in pool.map(one, probes) if f]


def send_code(
    job: str, version: str, probes: list[AgentProbe], signer: Signer, timeout_s: float
) -> list[str]:
    """A lazy hot update: each agent warms a zygote on ``version`` for its next restart.  Best
    effort (the restart carries the version anyway); what failed, for the log."""

    def one(p: AgentProbe) -> str:
        try:
            cmd = agent_client.code_command(job, p.node, version)
            status, reply = agent_client.send(p.url, cmd, signer, timeout_s)
        except (OSError, ValueError) as exc:
            return f"{p.url}: {exc}"
        return "" if status == 200 else f"{p.url}: HTTP {status} {reply.get('detail', '')}"

    if not probes:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(probes))) as pool:
        return [f for f in pool.map(one, probes) if f]
