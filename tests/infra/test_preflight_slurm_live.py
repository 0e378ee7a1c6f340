"""The preflight prolog on a real Slurm: a node whose test fails is drained with TrainGuard's reason
and the job runs on the others (issue #39, item 3).

A private cluster of three nodes (munged, slurmctld, three slurmd) in a temporary stack home on
free ports, like ``tests/actions/slurm_fixture.py``, with ``stack.slurm_prolog`` pointing at
``infra/deploy/prolog.sh`` (through a two-line wrapper naming its env file: slurmd gives a prolog
none of its own environment).  The env file makes ``gemm-digest`` fail on n1 only (a wrong
``--expected-digest``); the other nodes run the same test and pass.  ``sbatch -N 2`` gets n1 and n2
first (the lowest free nodes); n1's prolog drains it and fails, Slurm requeues the batch job
(``nohold_on_prolog_fail``: not held), and after Slurm's requeue delay (``cred_expire`` + 1 s,
121 s by default) the job runs on n2 and n3.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.actions.slurm_fixture import private_stack_env
from tests.infra.test_prolog import PROLOG, trainguard_shim
from tests.waiting import wait_until
from trainguard.actions.executors.slurm import expand_hostlist, parse_record
from trainguard.infra.config import load_settings
from trainguard.infra.stack.slurm import Slurm
from trainguard.schemas.codec import decode
from trainguard.schemas.telemetry import NodeCheck

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WRONG_DIGEST = "0" * 64


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Slurm]:
    tg = trainguard_shim(tmp_path / "trainguard", fake_diag=False)
    env_file = tmp_path / "preflight.env"
    env_file.write_text(
        f"TRAINGUARD_BIN={tg}\n"
        f"TRAINGUARD_PREFLIGHT_LOG_DIR={tmp_path / 'log'}\n"
        # three nodes share this host's two cores: the CPU digest takes longer than on a node
        "TRAINGUARD_PREFLIGHT_TIMEOUT_S=200\n"
        'TRAINGUARD_PREFLIGHT_ARGS="--test gemm-digest"\n'
        'if [ "$SLURMD_NODENAME" = n1 ]; then\n'
        f'    TRAINGUARD_PREFLIGHT_ARGS="--test gemm-digest --expected-digest {WRONG_DIGEST}"\n'
        "fi\n"
    )
    env_file.chmod(0o644)
    wrapper = tmp_path / "prolog.sh"
    wrapper.write_text(f"#!/bin/bash\nexport TRAINGUARD_PREFLIGHT_ENV={env_file}\nexec /bin/bash {PROLOG}\n")
    wrapper.chmod(0o755)
    env = {
        **private_stack_env(tmp_path / "home", 3),
        "TRAINGUARD__STACK__SLURM_PROLOG": str(wrapper),
    }
    slurm = Slurm(load_settings(environ=env).stack, nodes=3)
    try:
        slurm.start()
        slurm.wait_idle(60)
        yield slurm
    finally:
        slurm.stop()


def _records(log: Path, node: str) -> list[NodeCheck]:
    out = []
    for path in sorted((log / node).glob("*.json")):
        ev = decode(path.read_bytes(), NodeCheck)
        assert isinstance(ev, NodeCheck)
        out.append(ev)
    return out


def _logs(log: Path) -> str:
    return "\n".join(f"{p}:\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(log.glob("*/*.log")))


def test_a_failing_node_is_drained_and_the_job_runs_on_the_others(cluster: Slurm, tmp_path: Path) -> None:
    assert "Prolog=" in cluster.conf_file.read_text()
    out = tmp_path / "job-%j.out"
    res = cluster.run(
        "sbatch", "--parsable", "-N", "2", "--ntasks-per-node=1", "-J", "preflight-live", "-o", str(out),
        "--wrap", "srun bash -c 'echo ran-on $SLURMD_NODENAME'",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip().split(";")[0]
    log = tmp_path / "log"

    def job() -> dict[str, str]:
        return parse_record(cluster.run("scontrol", "-o", "show", "job", job_id).stdout)

    def node(name: str) -> dict[str, str]:
        return next(n for n in cluster.nodes() if n["name"] == name)

    drained = wait_until(
        lambda: node("n1") if node("n1")["state"].startswith("drain") else None,
        150,
        lambda: f"n1 drained; nodes {cluster.nodes()}, job {job()}; logs:\n{_logs(log)}",
    )
    assert drained["reason"].startswith("trainguard preflight: gemm-digest: cpu: digest"), drained
    assert "differs from the expected 0000000000000000" in drained["reason"]

    # Requeued, not held, then run on the two nodes that passed (after Slurm's requeue delay).
    done = wait_until(
        lambda: j if (j := job()).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED") else None,
        240,
        lambda: f"job {job_id} done; job {job()}, nodes {cluster.nodes()}; logs:\n{_logs(log)}",
    )
    assert done["JobState"] == "COMPLETED" and done.get("Restarts") == "1", done
    assert expand_hostlist(done["NodeList"]) == ["n2", "n3"], done
    ran = sorted(line.split()[1] for line in Path(str(out).replace("%j", job_id)).read_text().splitlines())
    assert ran == ["n2", "n3"]
    # Slurm drains a node whose prolog failed only if it is not drained yet: TrainGuard's reason stays.
    assert node("n1")["state"].startswith("drain") and node("n1")["reason"] == drained["reason"]
    assert not node("n2")["state"].startswith("drain")

    # What each node's prolog recorded: n1 failed and was drained; n2 passed twice, n3 once.
    (n1,) = _records(log, "n1")
    assert (n1.outcome.value, n1.action.value, n1.job, n1.failed_tests) == (
        "failed",
        "drained",
        job_id,
        ["gemm-digest"],
    )
    assert n1.reason == drained["reason"]
    assert [(c.outcome.value, c.action.value) for c in _records(log, "n2")] == [("passed", "none")] * 2
    assert [(c.outcome.value, c.action.value) for c in _records(log, "n3")] == [("passed", "none")]
