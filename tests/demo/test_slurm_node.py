"""The demo's Slurm-side commands (``trainguard_demo.slurm_node``): a rank's place from the
launcher's environment, and the per-node alignment check (exit code = verdict)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainguard_demo.config import LaunchSpec, write_atomic
from trainguard_demo.diagnostics.tests import alignment_digest
from trainguard_demo.slurm_node import base_spec_path, rank_argv, reference_path
from trainguard_demo.trainer import build_parser, spec_from_args


def _base(cluster: Path) -> LaunchSpec:
    spec = LaunchSpec(
        job="j", cluster_dir=str(cluster), tp=2, pp=2, dp=2, ranks_per_machine=2,
        machines=["n1", "n2", "n3", "n4"], steps=50, checkpoint_every=1,
    )  # fmt: skip
    base_spec_path(cluster, "j").parent.mkdir(parents=True)
    write_atomic(base_spec_path(cluster, "j"), spec.to_json())
    return spec


def test_a_rank_takes_its_machines_and_port_from_the_launcher(tmp_path: Path) -> None:
    base = _base(tmp_path)
    env = {
        "RANK": "3",
        "TRAINGUARD_MACHINES": "n1,n5,n3,n4",
        "MASTER_PORT": "24242",
        "MASTER_ADDR": "127.0.0.1",
    }
    spec, rank, argv = rank_argv(tmp_path, "j", env)
    assert (rank, spec.machine_names(), spec.master_port) == (3, ["n1", "n5", "n3", "n4"], 24242)
    assert (spec.steps, spec.tp, spec.model) == (base.steps, base.tp, base.model)  # the rest from the base
    assert argv[1:3] == ["-m", "trainguard_demo.trainer"]
    parsed, parsed_rank = spec_from_args(build_parser().parse_args(argv[3:]))
    # Rank 3 sits on the replacement n5: the exporter's pattern (--machine n5) finds it there.
    assert parsed_rank == 3 and parsed == spec and argv[argv.index("--machine") + 1] == "n5"


def test_a_rank_outside_the_launcher_says_what_is_missing(tmp_path: Path) -> None:
    _base(tmp_path)
    with pytest.raises(SystemExit, match=r"trainguard launch.*TRAINGUARD_MACHINES"):
        rank_argv(tmp_path, "j", {"RANK": "0", "MASTER_PORT": "1"})


@pytest.mark.parametrize("perturb", [False, True])
def test_the_node_check_fails_exactly_on_a_perturbed_machine(tmp_path: Path, perturb: bool) -> None:
    ref = reference_path(tmp_path)
    ref.parent.mkdir(parents=True)
    ref.write_text(json.dumps({"ok": True, "digest": alignment_digest(False)}))
    if perturb:  # what `trainguard inject ... gpu-lost` leaves on the machine
        (tmp_path / "machines" / "n2").mkdir(parents=True)
        (tmp_path / "machines" / "n2" / "diagnostics.json").write_text(json.dumps({"perturb": True}))
    res = subprocess.run(
        [sys.executable, "-m", "trainguard_demo.slurm_node", "check", "--cluster-dir", str(tmp_path)],
        env={**os.environ, "SLURMD_NODENAME": "n2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    verdict = json.loads(res.stdout.strip().splitlines()[-1])
    assert (res.returncode, verdict["ok"], verdict["node"]) == (
        (1, False, "n2") if perturb else (0, True, "n2")
    )
