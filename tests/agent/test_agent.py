"""Real node agents (real zygotes importing torch, real forks, a real 2-rank gloo job on CPU, real
Ed25519 signatures): in-place restart, standby join, hot updates, refused commands, a dead zygote.

One set of three agents serves the whole module (each zygote imports torch once); the tests run in
file order and each starts from the generation the previous one left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.agent.harness import (
    JOB,
    Keys,
    Running,
    free_port,
    make_code_root,
    make_keys,
    start_agent,
    wait_warm,
)
from tests.agent.harness import wait_first_step as first_step
from trainguard.agent import client
from trainguard.schemas.codec import decode
from trainguard.schemas.topics import COMMANDS
from trainguard.schemas.workload import ProcessExit, RankRegistration

#: Three agents whose zygotes import torch and a 2-rank gloo job: not the quick tier (docs/testing.md).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


class Job(SimpleNamespace):
    keys: Keys
    agents: dict[str, Running]
    out: Path
    tmp: Path
    exporter: Exporter


class Exporter:
    """The node exporter's end of the reporter socket: every event the agents send it."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.events: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.events.append(decode(self.sock.recv(65536), local=True))
            except TimeoutError:
                continue

    def exits(self) -> list[ProcessExit]:
        return [e for e in self.events if isinstance(e, ProcessExit)]

    def registered(self) -> set[int]:
        return {e.pid for e in self.events if isinstance(e, RankRegistration)}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    tmp = tmp_path_factory.mktemp("agents")
    out = tmp / "out"
    out.mkdir()
    keys = make_keys(tmp)
    make_code_root(tmp, ["v1", "v2"])
    port = free_port()
    exporter = Exporter(tmp / "reporter.sock")
    sock = str(tmp / "reporter.sock")
    agents = {
        "n1": start_agent(tmp, keys, "n1", out, ["n1", "n2"], port, reporter_socket=sock),
        "n2": start_agent(tmp, keys, "n2", out, ["n1", "n2"], port, reporter_socket=sock),
        "n3": start_agent(tmp, keys, "n3", out, reporter_socket=sock),  # the standby
    }
    try:
        for a in agents.values():
            wait_warm(a.agent.zygote)
        yield Job(keys=keys, agents=agents, out=out, tmp=tmp, exporter=exporter)
    finally:
        for a in agents.values():
            a.agent.stop()
        exporter.close()


def restart(job: Job, nodes: list[str], generation: int, port: int, version: str = "") -> dict[str, dict]:
    """Send the generation's restart to every agent (active and standby alike): node -> reply."""
    replies = {}
    for name, a in job.agents.items():
        cmd = client.restart_command(JOB, name, generation, nodes, "127.0.0.1", port, version)
        status, reply = client.send(a.url, cmd, job.keys.signer)
        assert status == 200, reply
        replies[name] = reply
    return replies


def pids(job: Job, node: str) -> list[int]:
    return [r["pid"] for r in job.agents[node].agent.snapshot()["ranks"]]


def test_the_first_world_trains_and_the_state_says_running(job: Job) -> None:
    for rank in (0, 1):
        ev = first_step(job.out, rank, 1)
        assert (ev["world"], ev["version"]) == (2, "v1")
    warm, doc = client.state(job.agents["n1"].url)
    assert warm and (doc["state"], doc["generation"], doc["nodes"]) == ("running", 1, ["n1", "n2"])
    on_disk = json.loads((job.tmp / "agents" / "n1" / "state.json").read_text())
    assert on_disk["job"] == JOB and on_disk["warm"] is True
    warm, doc = client.state(job.agents["n3"].url)
    assert warm and doc["state"] == "warm" and doc["ranks"] == []


def test_ranks_restart_in_place_on_a_new_port_and_generation(job: Job) -> None:
    old = pids(job, "n1") + pids(job, "n2")
    port = free_port()
    sent = time.time()
    replies = restart(job, ["n1", "n2"], 2, port)
    assert replies["n1"]["outcome"] == "done" and replies["n3"]["outcome"] == "done"
    steps = [first_step(job.out, rank, 2, timeout_s=60) for rank in (0, 1)]
    assert {(e["port"], e["world"]) for e in steps} == {(str(port), 2)}
    print(f"warm restart to first step: {max(e['ts'] for e in steps) - sent:.2f}s")
    new = pids(job, "n1") + pids(job, "n2")
    assert not set(old) & set(new)
    assert not any(_alive(p) for p in old)  # the old generation is gone, not left beside the new
    # The exporter follows the new ranks; the stopped ones are the recovery, not a fault to report.
    assert set(new) <= job.exporter.registered()
    assert not job.exporter.exits()


def test_forged_tampered_replayed_and_stale_commands_are_refused(job: Job) -> None:
    n1 = job.agents["n1"]
    before = pids(job, "n1")
    # Forged: signed by a key this cluster does not trust.
    cmd = client.restart_command(JOB, "n1", 9, ["n1"], "127.0.0.1", free_port())
    status, reply = client.send(n1.url, cmd, job.keys.forger)
    assert status == 403 and "unknown key id" in reply["reason"]
    # Tampered: a real signature over another generation.
    body, headers = client.signed_request(cmd, job.keys.signer)
    status, reply = client.post(n1.url, body.replace(b'"generation":9', b'"generation":8'), headers)
    assert status == 403 and "bad signature" in reply["reason"]
    # Stale: an authentic restart for the current generation is ignored, ranks untouched.
    stale = client.restart_command(JOB, "n1", 2, ["n1", "n2"], "127.0.0.1", free_port())
    body, headers = client.signed_request(stale, job.keys.signer)
    status, reply = client.post(n1.url, body, headers)
    assert status == 200 and reply["outcome"] == "ignored"
    # Replayed: the very same signed request again, over HTTP, then as a Kafka record.
    status, reply = client.post(n1.url, body, headers)
    assert status == 403 and "replayed" in reply["reason"]
    record = SimpleNamespace(
        topic=COMMANDS.name, partition=0, offset=77, key=b"n1", value=body, headers=list(_raw(headers))
    )
    refused = n1.agent.listener.dead_lettered
    n1.agent.listener.dispatch(record)
    assert n1.agent.listener.dead_lettered == refused + 1
    assert pids(job, "n1") == before and n1.agent.generation == 2
    dead = [
        json.loads(line)
        for line in (job.tmp / "agents" / "n1" / "dead-letters.jsonl").read_text().splitlines()
    ]
    assert len(dead) == 4 and all(d["stage"] == "exporter:command" for d in dead)
    assert "unknown key id" in dead[0]["reason"] and "replayed" in dead[-1]["reason"]


def test_a_rank_that_dies_on_its_own_is_reported_to_the_exporter(job: Job) -> None:
    (pid,) = pids(job, "n2")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(e.pid == pid for e in job.exporter.exits()):
        time.sleep(0.05)
    died = [e for e in job.exporter.exits() if e.pid == pid]
    assert [(e.rank, e.node, e.signal, e.exit_code) for e in died] == [(1, "n2", 9, 137)]


def test_a_standby_joins_in_the_evicted_machines_place(job: Job) -> None:
    port = free_port()
    replies = restart(job, ["n3", "n2"], 3, port)  # n1 evicted: n3 takes its ranks (rank 0)
    assert "standby" in replies["n1"]["detail"]
    ev = first_step(job.out, 0, 3, timeout_s=60)
    assert (ev["node"], ev["world"], ev["port"]) == ("n3", 2, str(port))
    assert first_step(job.out, 1, 3)["node"] == "n2"
    warm, doc = client.state(job.agents["n1"].url)
    assert warm and doc["state"] == "warm" and doc["ranks"] == [] and doc["generation"] == 3


def test_a_lazy_hot_update_is_taken_at_the_next_restart(job: Job) -> None:
    for name in ("n2", "n3"):
        status, reply = client.send(
            job.agents[name].url, client.code_command(JOB, name, "v2"), job.keys.signer
        )
        assert status == 200 and reply["outcome"] == "done"
    assert job.agents["n2"].agent.snapshot()["pending_code_version"] == "v2"
    for name in ("n2", "n3"):  # the new version's zygote warms up in the background
        wait_warm(job.agents[name].agent._pending_zygote)
    restart(job, ["n3", "n2"], 4, free_port())
    assert {first_step(job.out, r, 4)["version"] for r in (0, 1)} == {"v2"}
    doc = job.agents["n2"].agent.snapshot()
    assert (doc["code_version"], doc["pending_code_version"]) == ("v2", "")


def test_an_urgent_hot_update_restarts_now_on_the_given_version(job: Job) -> None:
    # v1's zygotes were stopped when v2 took over: the agents import v1 again, meanwhile they
    # answer GET /state at once, saying they are restarting.
    sender = threading.Thread(target=restart, args=(job, ["n3", "n2"], 5, free_port(), "v1"))
    sender.start()
    seen, slowest = set(), 0.0
    while sender.is_alive():
        asked = time.monotonic()
        seen.add(client.state(job.agents["n3"].url)[1].get("state"))
        slowest = max(slowest, time.monotonic() - asked)
        time.sleep(0.1)
    sender.join()
    assert "restarting" in seen and slowest < 2.0
    assert {first_step(job.out, r, 5, timeout_s=180)["version"] for r in (0, 1)} == {"v1"}


def test_a_dead_zygote_makes_the_agent_not_warm(job: Job) -> None:
    n1 = job.agents["n1"]
    os.kill(n1.agent.zygote.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and client.state(n1.url)[0]:
        time.sleep(0.05)
    warm, doc = client.state(n1.url)
    assert not warm and doc["warm"] is False  # GET /state answers 503: the executor goes cold
    # A restart that needs the zygote now fails loudly (dead-lettered) instead of hanging.
    n1.agent.zygote.dead.wait(5)
    cmd = client.restart_command(JOB, "n1", 6, ["n1", "n2"], "127.0.0.1", free_port())
    status, reply = client.send(n1.url, cmd, job.keys.signer)
    assert status == 403 and "not warm" in reply["reason"]


def _raw(headers: dict[str, str]) -> list[tuple[str, bytes]]:
    import base64

    return [(k, base64.b64decode(v) if k == "tg-sig" else v.encode()) for k, v in headers.items()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False
