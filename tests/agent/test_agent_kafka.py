"""A node agent on the real broker: a signed ``agent_restart`` published to ``control.commands``
restarts its rank; a forged one is dead-lettered.  The rank is a tiny script without torch (the
torch path is covered by test_agent.py; here the transport is what is tested)."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import pytest

from tests.agent.harness import make_keys
from tests.waiting import wait_until
from trainguard.agent import client
from trainguard.agent.config import AgentConfig
from trainguard.agent.service import NodeAgent
from trainguard.infra.bus import EventProducer
from trainguard.infra.config import Settings
from trainguard.schemas.config import load_config
from trainguard.schemas.topics import COMMANDS

RANK = """import json, os, sys, time
with open(os.path.join(os.environ["OUT"], "gen" + os.environ["TRAINGUARD_GENERATION"]), "w") as fh:
    json.dump({k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}, fh)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_restart_published_to_the_command_topic_restarts_the_rank(
    stack_settings: Settings, tmp_path: Path
) -> None:
    node, job = f"agent-{uuid.uuid4().hex[:8]}", "agent-kafka-job"
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "out").mkdir()
    keys = make_keys(tmp_path)
    cfg = load_config(
        AgentConfig,
        {
            "job": job,
            "node": node,
            "command": ["python", str(tmp_path / "rank.py")],
            "state_dir": str(tmp_path / "agent"),
            "host": "127.0.0.1",
            "port": 0,
            "stop_grace_s": 1.0,
        },
    )
    agent = NodeAgent(cfg, keys.verifier, stack_settings.kafka)
    agent.base_env["OUT"] = str(tmp_path / "out")
    threading.Thread(target=agent.run, daemon=True).start()
    try:
        assert agent.listener.ready.wait(60), "the agent's command consumer never got its partitions"
        wait_until(lambda: agent.zygote.warm, 60, "the zygote warm")
        forged = EventProducer(stack_settings.kafka, signer=keys.forger)
        forged.send(client.restart_command(job, node, 5, [node], "127.0.0.1", 29999), COMMANDS).get(
            timeout=30
        )
        forged.close()
        signed = EventProducer(stack_settings.kafka, signer=keys.signer)
        signed.send(client.restart_command(job, node, 1, ["other", node], "127.0.0.1", 29501), COMMANDS).get(
            timeout=30
        )
        signed.close()
        got = wait_until(lambda: (tmp_path / "out" / "gen1").exists(), 30, "generation 1's rank started")
        assert got
        env = json.loads((tmp_path / "out" / "gen1").read_text())
        assert env == {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29501"}
        assert not (tmp_path / "out" / "gen5").exists()
        dead = (tmp_path / "agent" / "dead-letters.jsonl").read_text().splitlines()
        assert len(dead) == 1 and "unknown key id" in json.loads(dead[0])["reason"]
        assert agent.snapshot()["generation"] == 1
    finally:
        agent.stop()
