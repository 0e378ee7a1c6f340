"""Real node agents for the agent tests and ``bench/warm_agent.py``: real keys, real zygotes
importing torch, real gloo ranks on CPU (small: one rank per agent)."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.agent.config import AgentConfig
from trainguard.agent.service import NodeAgent
from trainguard.agent.zygote_client import Zygote
from trainguard.infra.signing import Signer, SigningConfig, Verifier, init_keys
from trainguard.schemas.config import load_config

JOB = "agent-job"
SCRIPT = Path(__file__).with_name("gloo_job.py")
# torch._dynamo: what building DDP imports lazily (~900 modules, seconds on 2 cores): preloaded, a
# restarted rank builds DDP in milliseconds.
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "marker"]


@dataclass
class Keys:
    verifier: Verifier
    signer: Signer  # a trusted principal's (the action service's)
    forger: Signer  # a key nobody trusts


def make_keys(tmp: Path) -> Keys:
    init_keys(tmp / "keys", ["actions"])
    init_keys(tmp / "elsewhere", ["actions"])  # same principal, but not in our trusted.yaml
    ours, theirs = SigningConfig(keys_dir=str(tmp / "keys")), SigningConfig(keys_dir=str(tmp / "elsewhere"))
    return Keys(
        Verifier.load(ours, tmp), Signer.load(ours, tmp, "actions"), Signer.load(theirs, tmp, "actions")
    )


def make_code_root(tmp: Path, versions: list[str]) -> Path:
    """``tmp/code/<v>/`` for each version: the job script and a ``marker`` module saying ``v``."""
    root = tmp / "code"
    for v in versions:
        d = root / v
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(SCRIPT, d / SCRIPT.name)
        (d / "marker.py").write_text(f"VERSION = {v!r}\n")
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    agent: NodeAgent
    thread: threading.Thread
    url: str = field(default="")


def start_agent(
    tmp: Path,
    keys: Keys,
    node: str,
    out: Path,
    nodes: list[str] | None = None,
    master_port: int = 0,
    version: str = "v1",
    **extra: Any,
) -> Running:
    """A node agent for ``node`` serving on a free port, in a thread of this process (its zygote and
    ranks are real processes); ``nodes``: the first world (None: a standby)."""
    cfg = load_config(
        AgentConfig,
        {
            "job": JOB,
            "node": node,
            "command": ["python", SCRIPT.name],
            "preload": PRELOAD,
            "state_dir": str(tmp / "agents" / node),
            "host": "127.0.0.1",
            "port": 0,
            "kafka": False,
            "code_root": str(tmp / "code"),
            "code_version": version,
            "nodes": nodes or [],
            "generation": 1 if nodes else 0,
            "master_addr": "127.0.0.1",
            "master_port": master_port or 29500,
            "stop_grace_s": 2.0,
            **extra,
        },
    )
    agent = NodeAgent(cfg, keys.verifier)
    agent.base_env["AGENT_TEST_OUT"] = str(out)  # what the ranks inherit from the agent's environment
    thread = threading.Thread(target=agent.run, name=f"agent-{node}", daemon=True)
    thread.start()
    return Running(agent, thread, f"http://127.0.0.1:{agent.endpoint.port}")


def first_steps(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_first_step(out: Path, rank: int, generation: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """The ``first_step`` event of ``rank`` in ``generation`` (AssertionError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in first_steps(out, rank):
            if ev["generation"] == generation:
                return ev
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} took no step in generation {generation} within {timeout_s}s")


def wait_warm(zygote: Zygote | None, timeout_s: float = 180.0) -> None:
    """Until ``zygote`` (an agent's, or the one a lazy update pre-warms) has imported its list."""
    assert zygote is not None
    if not zygote.wait_ready(timeout_s):
        raise AssertionError(f"zygote not warm within {timeout_s}s: {zygote.error}")
