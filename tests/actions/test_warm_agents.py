"""The warm path's decisions (:mod:`trainguard.actions.executors.agents`): warm or cold from the
agents' states, the new world, the agents' URLs, and what counts as a failed restart -- against
real HTTP endpoints on this host (a stand-in agent that answers done, refuses or hangs)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.net import free_port
from trainguard.actions.executors.agents import (
    AgentProbe,
    agent_urls,
    next_world,
    probe,
    send_restarts,
    warm_verdict,
)
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.slurm import SlurmExecutor, SlurmExecutorConfig
from trainguard.infra.signing import Signer, SigningConfig, init_keys
from trainguard.schemas.config import ConfigError, load_config


def agent(node: str, state: str = "running", gen: int = 3, warm: bool = True, error: str = "") -> AgentProbe:
    doc = {"state": state, "generation": gen, "zygote": {"error": error}}
    return AgentProbe(node, f"http://127.0.0.1:1/{node}", warm, doc)


def test_every_agent_warm_is_the_warm_path() -> None:
    assert warm_verdict([agent("n1"), agent("n2", "warm")], ["n1", "n2"]) == ""


@pytest.mark.parametrize(
    ("probes", "why"),
    [
        ([agent("n1")], "no agent configured on n2"),
        ([agent("n1"), AgentProbe("n2", "http://x:9403", False, {})], "http://x:9403 (n2) does not answer"),
        ([agent("n1"), agent("n2", "starting", warm=False)], "(n2) is starting"),
        ([agent("n1"), agent("n2", "restarting")], "(n2) is restarting"),
        ([agent("n1"), agent("n2", "warm", warm=False, error="SyntaxError")], "is warm, SyntaxError"),
    ],
)
def test_one_agent_not_warm_is_the_cold_path_and_says_why(probes: list[AgentProbe], why: str) -> None:
    assert why in warm_verdict(probes, ["n1", "n2"])


def test_the_new_world_puts_the_replacement_in_the_evicted_place() -> None:
    probes = [agent("n1", gen=4), agent("n2", gen=6), agent("n3", "warm", gen=0)]
    # n2 evicted, standby n3 takes its place (the spec's order): rank order n1, n3
    addrs = {"n1": "10.0.0.1", "n3": "10.0.0.3"}
    w = next_world(probes, ["n1", "n3"], addrs, (29600, 29900))
    assert (w.generation, w.nodes, w.master_addr) == (7, ("n1", "n3"), "10.0.0.1")
    assert 29600 <= w.master_port < 29900
    # each generation a fresh port; the same generation (a re-sent command) the same one
    again = next_world(probes, ["n1", "n3"], addrs, (29600, 29900))
    later = next_world([agent("n1", gen=7)], ["n1", "n3"], addrs, (29600, 29900))
    assert again.master_port == w.master_port != later.master_port
    # no address from Slurm: the node's name
    assert next_world(probes, ["n3"], {}, (29600, 29900)).master_addr == "n3"


def test_agent_urls_per_rank_and_per_node_ports() -> None:
    urls = agent_urls(["n1", "n2"], {"n1": "127.0.0.1", "n2": "127.0.0.1"}, {"n1": 9410, "n2": 9420}, 9403, 2)
    assert urls == {
        "n1": ["http://127.0.0.1:9410", "http://127.0.0.1:9411"],
        "n2": ["http://127.0.0.1:9420", "http://127.0.0.1:9421"],
    }
    assert agent_urls(["gpu1"], {}, {}, 9403, 1) == {"gpu1": ["http://gpu1:9403"]}


def test_a_config_key_the_executor_does_not_know_is_an_error() -> None:
    cfg = load_config(SlurmExecutorConfig, {"agents": True, "agent_ports": {"n1": 9500}})
    assert cfg.agents and cfg.agent_ports == {"n1": 9500}
    with pytest.raises(ConfigError):
        load_config(SlurmExecutorConfig, {"agent_prot": 9403})
    with pytest.raises((ConfigError, ValueError)):
        load_config(SlurmExecutorConfig, {"agent_master_ports": [29900, 29600]})


# -- against HTTP endpoints ------------------------------------------------------------------------
class StandIn(BaseHTTPRequestHandler):
    """An agent's HTTP surface: ``mode`` done / refuse / hang; the commands it got."""

    mode = "done"
    got: list[dict] = []

    def do_GET(self) -> None:
        self._reply(200, {"state": "running", "generation": 2, "zygote": {"error": ""}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.got.append({"body": body, "signed": bool(self.headers.get("tg-sig"))})
        if self.mode == "hang":
            time.sleep(3)
        if self.mode == "refuse":
            self._reply(403, {"outcome": "refused", "detail": "zygote not warm"})
        else:
            self._reply(200, {"outcome": "done", "detail": "", "generation": body["args"]["generation"]})

    def _reply(self, status: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        # a hung reply's caller has given up and closed the connection
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def serve(mode: str) -> Iterator[str]:
    handler = type(f"StandIn_{mode}", (StandIn,), {"mode": mode})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def signer(tmp_path: Path) -> Signer:
    init_keys(tmp_path / "keys", ["actions"])
    return Signer.load(SigningConfig(keys_dir=str(tmp_path / "keys")), tmp_path, "actions")


def test_probe_reads_each_agents_state_and_a_silent_one_is_cold() -> None:
    for url in serve("done"):
        dead = f"http://127.0.0.1:{free_port()}"
        probes = probe({"n1": [url], "n2": [dead]}, timeout_s=2)
        assert [(p.node, p.warm, p.generation) for p in probes] == [("n1", True, 2), ("n2", False, 0)]
        assert "does not answer" in warm_verdict(probes, ["n1", "n2"])


@pytest.mark.parametrize(("mode", "failed"), [("done", False), ("refuse", True), ("hang", True)])
def test_a_refused_or_timed_out_restart_is_a_failure_to_fall_back_on(
    signer: Signer, mode: str, failed: bool
) -> None:
    StandIn.got = []
    for ok_url in serve("done"):
        for other in serve(mode):
            probes = [AgentProbe("n1", ok_url, True, {}), AgentProbe("n2", other, True, {})]
            world = next_world([agent("n1", gen=2)], ["n1", "n2"], {"n1": "127.0.0.1"}, (29600, 29900))
            problems = send_restarts("llm", world, probes, signer, timeout_s=1.0, code_version="v2")
            assert bool(problems) == failed, problems
            if failed:
                assert problems[0].startswith(f"{other} (n2)")
            # every agent got its own signed command of the same world, sent in parallel
            nodes = sorted(g["body"]["node"] for g in StandIn.got)
            assert nodes == ["n1", "n2"] and all(g["signed"] for g in StandIn.got)
            args = StandIn.got[0]["body"]["args"]
            assert (args["generation"], args["nodes"], args["code_version"]) == (3, ["n1", "n2"], "v2")


def test_a_hot_update_is_carried_by_the_next_restart_only(tmp_path: Path) -> None:
    """The version a hot update switched to goes with the next restart (warm: urgent on the
    agents; cold: the new step loads it anyway), not with every later one: agents started after
    it already run it, and one without a code root would refuse every restart forever."""
    ex = SlurmExecutor(SlurmExecutorConfig(agents=True), ExecutorEnv(state_dir=tmp_path))
    assert ex._take_agent_code("llm") == ""
    ex._set_agent_code("llm", "v3")
    assert ex._take_agent_code("llm") == "v3"
    assert ex._take_agent_code("llm") == ""
