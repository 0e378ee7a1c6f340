"""Machine positions read from configuration, Kubernetes node labels and Slurm's topology.conf
(plain data: no cluster needed)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from trainguard.actions.config import ActionsConfig
from trainguard.actions.executors.base import ExecutorEnv
from trainguard.actions.executors.kubernetes import KubernetesExecutor, KubernetesExecutorConfig
from trainguard.actions.executors.slurm import SlurmExecutor, SlurmExecutorConfig
from trainguard.actions.positions import (
    TopologyConfError,
    parse_topology_conf,
    position_from_labels,
    positions_from_mapping,
    positions_from_node_labels,
)
from trainguard.schemas.config import ConfigError, load_config
from trainguard.schemas.network import MachinePosition as P
from trainguard.schemas.typecheck import SchemaError

# A three-level fat tree as ib2slurm writes it: 2 spines (pods), 3 leaves (racks), a core.
TOPOLOGY_CONF = """\
# generated
SwitchName=ibsw1 Nodes=gpu[001-004]
SwitchName=ibsw2 Nodes=gpu[005-006,009] LinkSpeed=200
SwitchName=ibsw3 Nodes=gpu010,gpu[011-012]
SwitchName=spine-a Switches=ibsw[1-2]
switchname=spine-b switches=ibsw3    # lower case keys are Slurm's too
SwitchName=core Switches=spine-a,spine-b
"""


def test_topology_conf_gives_rack_and_spine_with_host_list_ranges() -> None:
    pos = parse_topology_conf(TOPOLOGY_CONF)
    assert sorted(pos) == [f"gpu{i:03d}" for i in (1, 2, 3, 4, 5, 6, 9, 10, 11, 12)]
    assert pos["gpu009"] == P("spine-a", "ibsw2") and pos["gpu011"] == P("spine-b", "ibsw3")
    assert {p.pod for p in parse_topology_conf(TOPOLOGY_CONF, pod_level=2).values()} == {"core"}
    assert parse_topology_conf(TOPOLOGY_CONF, pod_level=0)["gpu001"] == P("ibsw1", "ibsw1")


def test_a_two_level_tree_has_its_top_switch_as_the_pod() -> None:
    pos = parse_topology_conf("SwitchName=s0 Nodes=n[1-2]\nSwitchName=top Switches=s0\n", pod_level=3)
    assert pos["n1"] == P("top", "s0")
    alone = parse_topology_conf("SwitchName=s0 Nodes=n1")  # no spine at all: the leaf is the pod
    assert alone["n1"] == P("s0", "s0")


def test_scontrol_show_topology_output_reads_the_same() -> None:
    shown = (
        "SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n[1-2]\n"
        "SwitchName=s1 Level=0 LinkSpeed=1 Nodes=n[3-4]\n"
        "SwitchName=s2 Level=1 LinkSpeed=1 Switches=s[0-1] Nodes=n[1-4]\n"
    )
    pos = parse_topology_conf(shown)
    assert pos["n1"] == P("s2", "s0") and pos["n4"] == P("s2", "s1")  # the leaf listing keeps it


@pytest.mark.parametrize(
    ("text", "message"),
    [("Nodes=n1", "without SwitchName"), ("SwitchName=a Nodes=n1\nSwitchName=a Nodes=n2", "twice")],
)
def test_broken_topology_conf_is_refused(text: str, message: str) -> None:
    with pytest.raises(TopologyConfError, match=message):
        parse_topology_conf(text)


def test_a_switch_loop_does_not_hang_the_parser() -> None:
    pos = parse_topology_conf("SwitchName=a Nodes=n1 Switches=b\nSwitchName=b Switches=a\n", pod_level=5)
    assert pos["n1"] == P("b", "a")


def test_node_labels_first_key_set_wins() -> None:
    nodes = {
        "n1": {"network.topology.nvidia.com/spine": "sp1", "network.topology.nvidia.com/leaf": "lf3"},
        "n2": {"topology.kubernetes.io/zone": "z2"},
        "n3": {"kubernetes.io/hostname": "n3"},  # no position: left out
    }
    assert positions_from_node_labels(nodes) == {"n1": P("sp1", "lf3"), "n2": P("z2", "")}
    custom = position_from_labels({"example.com/pod": "p9", "example.com/rack": "r1"}, ["example.com/pod"])
    assert custom == P("p9", "")


def test_configured_positions_are_checked_like_any_config() -> None:
    assert positions_from_mapping({"n1": {"pod": "p1"}}) == {"n1": P("p1", "")}
    with pytest.raises(SchemaError, match=r"positions\.n1\.pod: expected a string"):
        positions_from_mapping({"n1": {"pod": 3}})
    cfg = load_config(
        ActionsConfig, {"placement": {"alpha": 2, "positions": {"n1": {"pod": "p1", "rack": "r"}}}}
    )
    assert cfg.placement.positions["n1"] == P("p1", "r") and cfg.placement.alpha == 2
    with pytest.raises(ConfigError, match="unknown field"):
        load_config(ActionsConfig, {"placement": {"gamma": 1}})
    env = {"TG__PLACEMENT__BETA": "0.5", "TG__PLACEMENT__ENABLED": "false"}
    from_env = load_config(ActionsConfig, {}, env_prefix="TG", environ=env).placement
    assert (from_env.beta, from_env.enabled) == (0.5, False)


def test_the_slurm_executor_reads_topology_conf(tmp_path: Path) -> None:
    conf = tmp_path / "topology.conf"
    conf.write_text(TOPOLOGY_CONF)
    ex = SlurmExecutor(SlurmExecutorConfig(topology_conf=str(conf)), ExecutorEnv(state_dir=tmp_path / "s"))
    assert ex.machine_positions(["gpu004", "gpu011", "elsewhere"]) == {
        "gpu004": P("spine-a", "ibsw1"),
        "gpu011": P("spine-b", "ibsw3"),
    }
    # By default, beside slurm.conf (Slurm keeps them in one directory).
    (tmp_path / "slurm.conf").write_text("ClusterName=x\n")
    beside = SlurmExecutor(
        SlurmExecutorConfig(slurm_conf=str(tmp_path / "slurm.conf")), ExecutorEnv(tmp_path / "b")
    )
    assert beside.machine_positions(["gpu001"]) == {"gpu001": P("spine-a", "ibsw1")}
    conf.unlink()
    assert beside.machine_positions(["gpu001"]) == {}


def test_the_kubernetes_executor_reads_node_labels(tmp_path: Path) -> None:
    ex = KubernetesExecutor(
        KubernetesExecutorConfig(
            topology_pod_labels=["example.com/pod"], topology_rack_labels=["example.com/rack"]
        ),
        ExecutorEnv(state_dir=tmp_path / "state"),
    )

    def node(name: str, labels: dict[str, str]) -> SimpleNamespace:
        return SimpleNamespace(metadata=SimpleNamespace(name=name, labels=labels))

    listed = [node("a", {"example.com/pod": "p1"}), node("b", {}), node("c", {"example.com/pod": "p2"})]
    ex.nodes = lambda ctx=None: listed  # type: ignore[method-assign]  # no API server here
    assert ex.machine_positions(["a", "b"]) == {"a": P("p1", "")}
