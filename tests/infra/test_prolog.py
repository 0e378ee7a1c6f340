"""``infra/deploy/prolog.sh`` run as slurmd runs it -- no PATH, settings from its env file -- with a
stand-in ``diag`` (canned results, an exit status, a hang) and a ``scontrol`` that records its
arguments; ``trainguard preflight`` is the real command.  The prolog on a real Slurm is
``test_preflight_slurm_live.py``.  Also: the local stack's slurm.conf lines for a prolog.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.infra.config import load_settings
from trainguard.infra.stack.slurm import SlurmConfig, slurm_conf
from trainguard.schemas.codec import decode
from trainguard.schemas.telemetry import NodeCheck

ROOT = Path(__file__).resolve().parents[2]
PROLOG = ROOT / "infra" / "deploy" / "prolog.sh"

BAD = {
    "test": "gemm-digest",
    "passed": False,
    "findings": ["cpu: digest 9f86d081... differs from the expected 0000..."],
}
GOOD = {"test": "gemm-digest", "passed": True, "findings": []}


def trainguard_shim(path: Path, fake_diag: bool) -> Path:
    """An executable ``trainguard`` of this checkout: its ``preflight`` command is registered here
    (the installed entry points are only as new as the last ``pip install -e``).  With
    ``fake_diag``, ``diag`` writes $FAKE_LINES to --out, sleeps $FAKE_SLEEP and exits $FAKE_EXIT,
    and ``preflight cordon`` appends its arguments to $CORDON_CALLS (no Kubernetes here)."""
    fake = (
        'if [ "$1" = diag ]; then\n'
        '  out=""; while [ $# -gt 0 ]; do [ "$1" = --out ] && out="$2"; shift; done\n'
        '  echo "diag args seen" >&2; [ -n "${FAKE_SLEEP:-}" ] && sleep "$FAKE_SLEEP"\n'
        '  cp "$FAKE_LINES" "$out"; echo "$FAKE_STDERR" >&2; exit "$FAKE_EXIT"\n'
        "fi\n"
        'if [ "$1 $2" = "preflight cordon" ]; then printf "%s\\n" "$@" >> "$CORDON_CALLS"; exit 0; fi\n'
        if fake_diag
        else ""
    )
    py = (
        "import sys; from trainguard.cli import main; from trainguard.commands.preflight import preflight; "
        "main.add_command(preflight); main(prog_name='trainguard')"
    )
    path.write_text(
        f'#!/bin/bash\n{fake}export PYTHONPATH="{ROOT}"\nexec "{sys.executable}" -c "{py}" "$@"\n'
    )
    path.chmod(0o755)
    return path


class Node:
    """One prolog run's world: its env file, stand-ins and log directory."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.bin.mkdir()
        self.log_dir = tmp / "log"
        self.calls = tmp / "scontrol.calls"
        scontrol = self.bin / "scontrol"
        scontrol.write_text(
            f'#!/bin/bash\nprintf "%s\\n" "$@" >> "{self.calls}"\nexit "${{SCONTROL_EXIT:-0}}"\n'
        )
        scontrol.chmod(0o755)
        self.tg = trainguard_shim(self.bin / "trainguard", fake_diag=True)
        self.env_file = tmp / "preflight.env"
        self.settings: dict[str, str] = {
            "TRAINGUARD_BIN": str(self.tg),
            "TRAINGUARD_PREFLIGHT_LOG_DIR": str(self.log_dir),
        }

    def run(
        self,
        lines: list[dict[str, object]],
        diag_exit: int,
        base: dict[str, str] | None = None,
        **settings: str,
    ) -> subprocess.CompletedProcess[str]:
        """Run the prolog; ``settings`` go to its env file, but ``stderr`` (diag's last words),
        ``FAKE_SLEEP`` and ``SCONTROL_EXIT`` are the stand-ins' own; ``base``: the environment the
        script starts with (default: what slurmd gives a prolog -- no PATH, the job and node)."""
        (self.tmp / "lines.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        env = {
            **({"SLURMD_NODENAME": "n7", "SLURM_JOB_ID": "4242"} if base is None else base),
            "TRAINGUARD_PREFLIGHT_ENV": str(self.env_file),
            "CORDON_CALLS": str(self.tmp / "cordon.calls"),
            "FAKE_LINES": str(self.tmp / "lines.jsonl"),
            "FAKE_EXIT": str(diag_exit),
            "FAKE_STDERR": settings.pop("stderr", ""),
            "FAKE_SLEEP": settings.pop("FAKE_SLEEP", ""),
            "SCONTROL_EXIT": settings.pop("SCONTROL_EXIT", "0"),
        }
        body = {**self.settings, **settings}
        self.env_file.write_text(
            f'PATH="{self.bin}:$PATH"\n'  # the prolog sets its own PATH first; the file may extend it
            + "".join(f"{k}='{v}'\n" for k, v in body.items())
        )
        self.env_file.chmod(0o644)
        return subprocess.run(["/bin/bash", str(PROLOG)], env=env, capture_output=True, text=True, timeout=60)

    def scontrol(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []

    def records(self, node: str = "n7") -> list[NodeCheck]:
        out = []
        for p in sorted((self.log_dir / node).glob("*.json")):
            ev = decode(p.read_bytes(), NodeCheck)
            assert isinstance(ev, NodeCheck)
            out.append(ev)
        return out

    def log(self) -> str:
        path = self.log_dir / "n7" / "preflight.log"
        return path.read_text() if path.exists() else ""


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_a_failed_test_drains_the_node_records_it_and_exits_1(node: Node) -> None:
    res = node.run([BAD], 1)
    assert res.returncode == 1, res.stderr + node.log()
    reason = "trainguard preflight: gemm-digest: cpu: digest 9f86d081... differs from the expected 0000..."
    assert node.scontrol() == ["update", "NodeName=n7", "State=DRAIN", f"Reason={reason}"]
    (check,) = node.records()
    assert (check.outcome.value, check.action.value, check.job, check.origin, check.reason) == (
        "failed",
        "drained",
        "4242",
        "slurm-prolog",
        reason,
    )
    assert "outcome=failed action=drained policy=drain reason=trainguard preflight: gemm-digest" in node.log()
    (results,) = (node.log_dir / "n7").glob("*-4242-*.jsonl")
    assert json.loads(results.read_text()) == BAD


def test_warn_records_and_lets_the_job_start(node: Node) -> None:
    res = node.run([BAD], 1, TRAINGUARD_PREFLIGHT_POLICY="warn")
    assert res.returncode == 0 and node.scontrol() == []
    assert [c.action.value for c in node.records()] == ["warned"]


def test_a_passing_node_is_left_alone(node: Node) -> None:
    res = node.run([GOOD], 0)
    assert res.returncode == 0 and node.scontrol() == []
    (check,) = node.records()
    assert (check.outcome.value, check.action.value, check.reason) == ("passed", "none", "")


def test_a_refused_drain_still_fails_the_prolog_and_says_so(node: Node) -> None:
    res = node.run([BAD], 1, SCONTROL_EXIT="1")
    assert res.returncode == 1  # Slurm drains the node itself on a failed prolog
    assert [c.action.value for c in node.records()] == ["drain_failed"]


def test_a_hang_fails_the_node(node: Node) -> None:
    res = node.run([GOOD], 0, TRAINGUARD_PREFLIGHT_TIMEOUT_S="1", FAKE_SLEEP="30")
    assert res.returncode == 1
    (check,) = node.records()
    assert check.failed_tests == ["timeout"] and "did not finish in 1 s" in check.reason


def test_diag_that_cannot_run_is_allowed_by_default_and_drains_on_request(node: Node) -> None:
    res = node.run([], 2, stderr="Error: No such option: --expected-digset")
    assert res.returncode == 0 and node.scontrol() == []
    (check,) = node.records()
    assert check.outcome.value == "error" and check.reason.endswith("No such option: --expected-digset")
    res = node.run([], 2, TRAINGUARD_PREFLIGHT_ON_ERROR="drain")
    assert res.returncode == 1 and node.scontrol()[2] == "State=DRAIN"


def test_its_own_failures_never_drain(node: Node, tmp_path: Path) -> None:
    res = node.run([BAD], 1, TRAINGUARD_BIN=str(tmp_path / "nowhere"))
    assert res.returncode == 0 and node.scontrol() == []
    assert "is not an executable (set TRAINGUARD_BIN" in node.log()
    res = node.run([BAD], 1, TRAINGUARD_PREFLIGHT_POLICY="drian")
    assert res.returncode == 0 and "neither drain nor warn: using warn" in node.log()
    res = node.run([BAD], 1, TRAINGUARD_PREFLIGHT_ENABLED="0")
    assert res.returncode == 0 and len(node.records()) == 1  # only the warn run above recorded


def test_an_env_file_others_can_write_is_not_sourced(node: Node) -> None:
    node.run([GOOD], 0)
    node.env_file.chmod(0o666)
    env = {"SLURMD_NODENAME": "n7", "TRAINGUARD_PREFLIGHT_ENV": str(node.env_file)}
    res = subprocess.run(["/bin/bash", str(PROLOG)], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "writable by group or others (mode 666): preflight skipped" in res.stderr


def test_on_kubernetes_it_cordons_the_node_of_the_pod(node: Node, tmp_path: Path) -> None:
    pod = "llm-worker-" + "x" * 200  # a pod name may be longer than a job name: cut to 128
    base = {"NODE_NAME": "gpu-3", "POD_NAME": pod, "PATH": "/usr/bin:/bin"}
    res = node.run([BAD], 1, base=base, TRAINGUARD_PREFLIGHT_SCHEDULER="kubernetes")
    assert res.returncode == 1, res.stderr
    calls = (tmp_path / "cordon.calls").read_text().splitlines()
    assert calls[:4] == ["preflight", "cordon", "--node", "gpu-3"] and calls[-2:] == ["--pod", pod]
    assert calls[5].startswith("trainguard preflight: gemm-digest: cpu: digest") and node.scontrol() == []
    (check,) = node.records("gpu-3")
    assert (check.origin, check.job, check.action.value) == ("k8s-init", pod[:128], "cordoned")


def test_the_configmap_holds_this_script_and_the_example_pod_runs_it() -> None:
    import yaml

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from preflight_configmap import MANIFEST, render
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert MANIFEST.read_text() == render(), "stale: run scripts/preflight_configmap.py"
    (cm,) = yaml.safe_load_all(MANIFEST.read_text())
    assert cm["data"]["preflight.sh"] == PROLOG.read_text()
    k8s = PROLOG.parent / "k8s" / "preflight"
    (job,) = yaml.safe_load_all((k8s / "example-job.yaml").read_text())
    pod = job["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in init["env"]}
    assert env["TRAINGUARD_PREFLIGHT_SCHEDULER"] == "kubernetes" and init["command"][-1].endswith(
        "preflight.sh"
    )
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # only the init container has the ServiceAccount's token, and the failed pod is not retried in place
    assert pod["automountServiceAccountToken"] is False and pod["restartPolicy"] == "Never"
    assert not any(
        "serviceaccount" in m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])
    )
    sa, role, binding = yaml.safe_load_all((k8s / "rbac.yaml").read_text())
    assert pod["serviceAccountName"] == sa["metadata"]["name"] == binding["subjects"][0]["name"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]


def test_the_stack_writes_prolog_lines_only_when_configured(tmp_path: Path) -> None:
    plain = slurm_conf(SlurmConfig(nodes=3), tmp_path, tmp_path / "m")
    assert "Prolog" not in plain and "SchedulerParameters" not in plain
    stack = load_settings(environ={"TRAINGUARD__STACK__SLURM_PROLOG": str(PROLOG)}).stack
    conf = slurm_conf(SlurmConfig.from_stack(stack, nodes=3), tmp_path, tmp_path / "m")
    assert (
        f"\nProlog={PROLOG}\nPrologFlags=Alloc,DeferBatch\nSchedulerParameters=nohold_on_prolog_fail\n"
        in conf
    )
    held = slurm_conf(SlurmConfig(nodes=3, prolog=str(PROLOG), prolog_hold=True), tmp_path, tmp_path / "m")
    assert "PrologFlags=Alloc,DeferBatch\n" in held and "nohold_on_prolog_fail" not in held
    with pytest.raises(ValueError, match="must be an absolute path"):
        SlurmConfig(prolog="prolog.sh")


def test_the_script_is_executable() -> None:
    assert os.access(PROLOG, os.X_OK)
