"""Slurm environment -> launch plan (``trainguard.launch_env``): pure, no Slurm needed."""

from __future__ import annotations

import doctest
import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainguard import launch_env
from trainguard.commands import launch as launch_command
from trainguard.commands.launch import launch
from trainguard.infra.signing import (
    COMMANDS,
    CONTROL,
    DECISIONS,
    JOBS,
    ROLE_TOPICS,
    AuthError,
    Signer,
    SigningConfig,
    Verifier,
    init_keys,
)
from trainguard.launch_env import (
    LaunchConfig,
    LaunchError,
    derived_port,
    find_master,
    parse_tasks_per_node,
    plan_launch,
    scontrol_show_node,
)
from trainguard.schemas.codec import decode, encode
from trainguard.schemas.control import JobSpec
from trainguard.streams.reporter import DEFAULT_SOCKET

NOW = 1_700_000_000_000


def slurm_env(**over: str) -> dict[str, str]:
    """A task of ``srun -N 4 --ntasks-per-node=2`` in a 6-node allocation: rank 5 on n3."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "1",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_TASKS_PER_NODE": "2(x4)",
        "SLURM_STEP_NODELIST": "n[1-4]",
        "SLURM_JOB_NODELIST": "n[1-6]",
        "SLURMD_NODENAME": "n3",
    }
    env.update(over)
    return {k: v for k, v in env.items() if v != "-"}  # "-": leave the variable out


def test_four_nodes_two_ranks_each_in_a_six_node_allocation() -> None:
    plan = plan_launch(LaunchConfig(job="llm", tp=2, pp=2), slurm_env())
    t = plan.topology
    assert (t.tp, t.pp, t.dp, t.ranks_per_machine, t.world_size) == (2, 2, 2, 2, 8)
    assert t.machines == ["n1", "n2", "n3", "n4"] and plan.standbys == ["n5", "n6"]
    assert (plan.rank, plan.local_rank, plan.node, plan.slurm_job_id, plan.step_id) == (
        5,
        1,
        "n3",
        "4242",
        "1",
    )
    assert t.machine_name(t.machine_of(plan.rank)) == "n3"  # the topology agrees with Slurm's placement
    assert plan.child_env() == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "24242",
        "TRAINGUARD_JOB": "llm",
        "TRAINGUARD_RANK": "5",
        "TRAINGUARD_NODE": "n3",
        "TRAINGUARD_MACHINES": "n1,n2,n3,n4",
        "TRAINGUARD_REPORTER_SOCKET": DEFAULT_SOCKET,
    }
    assert not plan.publishes  # rank 5


def test_a_step_the_action_service_started_keeps_its_node_order() -> None:
    # n5 took the evicted n2's place: srun --distribution=arbitrary put ranks 2-3 on n5, and
    # Slurm's own node list (sorted) would say n3.
    env = slurm_env(
        SLURM_STEP_NODELIST="n[1,3-5]", SLURM_PROCID="2", SLURM_LOCALID="0", SLURMD_NODENAME="n5",
        TRAINGUARD_NODES="n1,n5,n3,n4", TRAINGUARD_RESTART="1",
    )  # fmt: skip
    plan = plan_launch(LaunchConfig(job="llm", tp=2, pp=2), env)
    assert plan.topology.machines == ["n1", "n5", "n3", "n4"] and plan.node == "n5"
    assert plan.standbys == ["n2", "n6"] and plan.child_env()["TRAINGUARD_MACHINES"] == "n1,n5,n3,n4"
    with pytest.raises(LaunchError, match="other nodes than the step's"):
        plan_launch(LaunchConfig(job="llm", tp=2, pp=2), {**env, "TRAINGUARD_NODES": "n1,n2,n3,n4"})


def test_zero_padded_ranges_and_ntasks_per_node_only() -> None:
    env = slurm_env(
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NTASKS="32",
        SLURM_TASKS_PER_NODE="-",
        SLURM_NTASKS_PER_NODE="8",
        SLURM_STEP_NODELIST="gpu-[01-03,07]",
        SLURM_JOB_NODELIST="gpu-[01-03,07-08],login1",
        SLURMD_NODENAME="gpu-01",
    )
    plan = plan_launch(LaunchConfig(job="llm", tp=8, pp=2), env)
    assert plan.topology.machines == ["gpu-01", "gpu-02", "gpu-03", "gpu-07"]
    assert plan.standbys == ["gpu-08", "login1"]
    assert (plan.topology.dp, plan.topology.ranks_per_machine, plan.master_addr) == (2, 8, "gpu-01")
    assert plan.publishes  # rank 0 of the job's own step


def test_the_step_layout_wins_over_the_allocation_inherited_from_sbatch() -> None:
    # sbatch --ntasks-per-node=4 exports SLURM_NTASKS_PER_NODE=4 to its steps; this step runs 2.
    env = slurm_env(SLURM_NTASKS_PER_NODE="4", SLURM_STEP_TASKS_PER_NODE="2(x4)", SLURM_STEP_NUM_TASKS="8")
    env["SLURM_NTASKS"] = "16"
    plan = plan_launch(LaunchConfig(job="j", dp=8), env)
    assert (plan.topology.ranks_per_machine, plan.world_size) == (2, 8)


def test_one_node_one_task_and_no_allocation_list() -> None:
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_TASKS_PER_NODE": "1",
        "SLURM_STEP_NODELIST": "node-a",
    }
    plan = plan_launch(LaunchConfig(job="tiny"), env)
    assert (plan.node, plan.local_rank, plan.standbys, plan.topology.machines) == (
        "node-a",
        0,
        [],
        ["node-a"],
    )


def test_options_override_rendezvous_socket_and_fill_placeholders() -> None:
    cfg = LaunchConfig(
        job="llm",
        tp=2,
        pp=2,
        master_addr="10.0.0.1",
        master_port=29500,
        reporter_socket="/tmp/tg-{job_id}/{node}/reporter.sock",
        ready_file="/tmp/tg-{job_id}/ready-{step_id}-{rank}-{local_rank}.json",
    )
    plan = plan_launch(cfg, slurm_env())
    assert (plan.master_addr, plan.master_port) == ("10.0.0.1", 29500)
    assert plan.reporter_socket == "/tmp/tg-4242/n3/reporter.sock"
    assert plan.ready_file == "/tmp/tg-4242/ready-1-5-1.json"
    # Without the option, the exporter socket a site exported for its jobs.
    env = slurm_env(TRAINGUARD_REPORTER_SOCKET="/run/tg/r.sock")
    assert plan_launch(LaunchConfig(job="llm", tp=2, pp=2), env).reporter_socket == "/run/tg/r.sock"
    with pytest.raises(LaunchError, match=r"bad placeholder .*use \{job_id\}"):
        plan_launch(LaunchConfig(job="llm", tp=2, pp=2, ready_file="/tmp/{host}"), slurm_env())


def test_a_step_the_action_service_restarted_publishes_no_spec() -> None:
    env = slurm_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURMD_NODENAME="n1", TRAINGUARD_RESTART="2")
    plan = plan_launch(LaunchConfig(job="llm", tp=2, pp=2), env)
    assert plan.restart == 2 and not plan.publishes
    env["TRAINGUARD_RESTART"] = "0"
    assert plan_launch(LaunchConfig(job="llm", tp=2, pp=2), env).publishes
    assert not plan_launch(LaunchConfig(job="llm", tp=2, pp=2, publish=False), env).publishes


def test_job_spec_carries_machines_standbys_and_ranks_and_survives_the_codec() -> None:
    plan = plan_launch(LaunchConfig(job="llm", tp=2, pp=2), slurm_env())
    spec = plan.job_spec(ts_ms=1_700_000_000_000)
    assert decode(encode(spec), expect=JobSpec) == spec
    assert spec.topology.machines == ["n1", "n2", "n3", "n4"] and spec.standbys == ["n5", "n6"]
    assert spec.topology.ranks_of_machine(2) == [4, 5]


@pytest.mark.parametrize(
    ("over", "cfg", "match"),
    [
        ({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NTASKS": "7"}, {}, r"different task counts per node"),
        ({"SLURM_STEP_ID": "-"}, {}, r"SLURM_STEP_ID is not set: run .* under srun"),
        ({"SLURM_JOB_ID": "-"}, {}, r"SLURM_JOB_ID not set"),
        ({"SLURM_PROCID": "-"}, {}, r"SLURM_PROCID not set"),
        ({"SLURM_PROCID": "five"}, {}, r"SLURM_PROCID='five' is not a non-negative integer"),
        ({"SLURM_NTASKS": "-"}, {}, r"SLURM_STEP_NUM_TASKS / SLURM_NTASKS not set"),
        (
            {"SLURM_STEP_NODELIST": "-", "SLURM_JOB_NODELIST": "-"},
            {},
            r"SLURM_STEP_NODELIST / SLURM_JOB_NODELIST",
        ),
        (
            {"SLURM_TASKS_PER_NODE": "-"},
            {},
            r"SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE",
        ),
        ({"SLURM_TASKS_PER_NODE": "2(x)"}, {}, r"not a Slurm task count list"),
        ({"SLURM_STEP_NODELIST": "n[1-"}, {}, r"SLURM_STEP_NODELIST='n\[1-' is not a Slurm host list"),
        ({"SLURM_STEP_NODELIST": "n[1-x]"}, {}, r"is not a Slurm host list"),
        ({"SLURM_STEP_NODELIST": "n[1-2],n2,n3"}, {}, r"names a node twice"),
        ({"SLURM_NTASKS": "6"}, {}, r"6 tasks but 4 node\(s\) x 2 task\(s\) per node = 8"),
        ({"SLURM_PROCID": "9"}, {}, r"SLURM_PROCID=9 is outside the step's 8 tasks"),
        ({}, {"tp": 3}, r"tp 3 x pp 2 x no dp divides 8 tasks"),
        ({}, {"dp": 4}, r"tp 2 x pp 2 x dp 4: the topology needs tp\*pp\*dp = 8 ranks"),
        (
            {"SLURMD_NODENAME": "n1"},
            {},
            r"rank 5 runs on n1 but block placement puts it on n3.*distribution=block",
        ),
        ({"SLURM_LOCALID": "0"}, {}, r"SLURM_LOCALID=0 of rank 5: block placement .* gives 1"),
        ({"TRAINGUARD_RESTART": "soon"}, {}, r"TRAINGUARD_RESTART='soon' is not a number"),
    ],
)
def test_bad_environments_say_what_is_wrong(over: dict[str, str], cfg: dict[str, int], match: str) -> None:
    with pytest.raises(LaunchError, match=match):
        config = LaunchConfig(job="llm", tp=cfg.get("tp", 2), pp=2, dp=cfg.get("dp", 0))
        plan_launch(config, slurm_env(**over))


def test_tasks_per_node_and_port_derivation() -> None:
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4(x2)") == [4, 4] and parse_tasks_per_node("8") == [8]
    assert derived_port("4242") == 24242 and derived_port("104242") == 24242
    assert 20000 <= derived_port("4242_7") < 30000  # a non-numeric id hashes into the same range
    assert derived_port("4242_7") == derived_port("4242_7")


def test_config_refuses_bad_names_and_orders() -> None:
    with pytest.raises(ValueError, match="job name 'my job' holds ' ' at character 2"):
        LaunchConfig(job="my job")
    with pytest.raises(ValueError, match="job name '-rf' starts with '-'"):
        LaunchConfig(job="-rf")
    with pytest.raises(ValueError, match="permutation of tp, dp, pp"):
        LaunchConfig(job="j", order="tp-dp-ep")


@pytest.mark.parametrize(
    ("args", "code", "match"),
    [
        (["--job", "j", "--tp", "0", "--", "true"], 2, "--tp: 0 is below the minimum 1"),
        (["--job", "j", "--publish-timeout", "0.1", "--", "true"], 2, "--publish-timeout: 0.1 is below"),
        (["--job", "j", "--order", "a-b-c", "--", "true"], 2, "permutation of tp, dp, pp"),
        (["--job", "j"], 2, "give the training command after --"),
        (["--", "true"], 2, "Missing option '--job'"),
        (["--job", "j", "--", "true"], 1, "trainguard launch: SLURM_JOB_ID not set"),
    ],
)
def test_bad_input_is_a_clear_error_not_a_traceback(args: list[str], code: int, match: str) -> None:
    res = CliRunner().invoke(launch, args, env=dict.fromkeys(slurm_env()), obj={})
    assert res.exit_code == code, res.output
    assert match in res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)


def test_the_launcher_key_signs_job_specs_only(tmp_path: Path) -> None:
    """The key that sits on training nodes (readable by the users' jobs) can declare a job, but
    cannot sign a decision (an eviction) or an exporter command."""
    assert ROLE_TOPICS["launcher"] == frozenset({JOBS})
    kids = init_keys(tmp_path / "keys")
    assert "launcher" in kids
    cfg = SigningConfig()
    signer = Signer.load(cfg, tmp_path, "launcher")
    value = encode(plan_launch(LaunchConfig(job="llm", tp=2, pp=2), slurm_env()).job_spec())
    headers = signer.headers(JOBS, b"llm", value, now_ms=NOW)
    assert Verifier.load(cfg, tmp_path).verify(JOBS, b"llm", value, headers, NOW) == "launcher"
    for topic in (DECISIONS, COMMANDS, CONTROL):
        with pytest.raises(AuthError, match=f"principal launcher may not sign topic {topic}"):
            signer.headers(topic, b"llm", value, now_ms=NOW)
    # A record of another topic made to look as if the launcher signed it is refused too.
    forged = [(k, v) for k, v in headers]
    with pytest.raises(AuthError):
        Verifier.load(cfg, tmp_path).verify(DECISIONS, b"llm", value, forged, NOW)


def test_the_modules_examples_hold() -> None:
    # pytest's --doctest-modules covers the layers below the CLI, not ``trainguard/``: run them here.
    for module in (launch_env, launch_command):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, module.__name__


TOPOLOGY_CONF = """# two pods: spine1 over racks leaf1-2, spine2 over leaf3
SwitchName=leaf1 Nodes=n[1-2]
SwitchName=leaf2 Nodes=n[3-4]
SwitchName=leaf3 Nodes=n5
SwitchName=spine1 Switches=leaf[1-2]
SwitchName=spine2 Switches=leaf3
"""


def test_rank_0_reads_network_positions_from_topology_conf_beside_slurm_conf(tmp_path: Path) -> None:
    (tmp_path / "topology.conf").write_text(TOPOLOGY_CONF)
    env = slurm_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURMD_NODENAME="n1",
                    SLURM_CONF=str(tmp_path / "slurm.conf"))  # fmt: skip
    cfg = LaunchConfig(job="llm")
    plan, note = launch_env.read_positions(plan_launch(cfg, env), cfg, env)
    pos = {m: (p.pod, p.rack) for m, p in plan.positions.items()}
    assert pos == {"n1": ("spine1", "leaf1"), "n2": ("spine1", "leaf1"), "n3": ("spine1", "leaf2"),
                   "n4": ("spine1", "leaf2"), "n5": ("spine2", "leaf3")}  # fmt: skip
    assert note.startswith(f"network positions of 5 node(s) from {tmp_path / 'topology.conf'}")
    assert note.endswith("not listed there: n6")  # a standby the file does not place
    spec = plan.job_spec(ts_ms=NOW)
    back = decode(encode(spec), expect=JobSpec)
    assert isinstance(back, JobSpec) and back.positions == plan.positions


def test_no_or_bad_topology_conf_leaves_the_spec_without_positions(tmp_path: Path) -> None:
    env = slurm_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURMD_NODENAME="n1")
    absent = LaunchConfig(job="llm", topology_conf=str(tmp_path / "none.conf"))
    plan, note = launch_env.read_positions(plan_launch(absent, env), absent, env)
    assert (plan.positions, note) == ({}, "")
    (tmp_path / "bad.conf").write_text("Nodes=n[1-2]\n")  # no SwitchName: Slurm refuses it too
    bad = LaunchConfig(job="llm", topology_conf=str(tmp_path / "bad.conf"))
    plan, note = launch_env.read_positions(plan_launch(bad, env), bad, env)
    assert plan.positions == {} and "without network positions" in note
    assert launch_env.topology_conf_path(LaunchConfig(job="llm"), {}) == "/etc/slurm/topology.conf"


FAKE_SCONTROL = """#!/bin/sh
# A stand-in for Slurm's scontrol: logs its arguments, answers `show node NAME -o` as Slurm does.
echo "$@" >> "$SCONTROL_LOG"
[ "$1 $2 $4" = "show node -o" ] || { echo "unexpected: $*" >&2; exit 2; }
case "$3" in
  n*) num=${3%%.*}; echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1  NodeAddr=10.9.0.${num#n} NodeHostName=$3" ;;
  *) echo "Node $3 not found" >&2; exit 1 ;;
esac
"""


def fake_scontrol(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH finds :data:`FAKE_SCONTROL` first; its calls go to ``scontrol.log``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(FAKE_SCONTROL)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "SCONTROL_LOG": str(tmp_path / "scontrol.log")}


def test_the_master_is_rank_0s_node_by_name_when_it_resolves_else_by_its_node_addr(tmp_path: Path) -> None:
    env = {**slurm_env(), **fake_scontrol(tmp_path)}
    cfg = LaunchConfig(job="llm", tp=2)
    plan = plan_launch(cfg, env)
    asked: list[str] = []

    def resolves(name: str) -> bool:
        asked.append(name)
        return name == "n1"

    # The name resolves: it is the address, and Slurm is not asked.
    found = find_master(plan, cfg, env, resolves=resolves)
    assert (found.master_addr, found.master_from) == ("n1", "rank 0's node n1 (its name resolves)")
    assert asked == ["n1"] and not (tmp_path / "scontrol.log").exists()
    assert found.child_env()["MASTER_ADDR"] == "n1"

    # It does not (the local stack's n1..n6): the NodeAddr scontrol gives, from one query.
    found = find_master(plan, cfg, env, resolves=lambda name: False)
    assert found.master_addr == "10.9.0.1" and found.child_env()["MASTER_ADDR"] == "10.9.0.1"
    assert found.master_from == "NodeAddr of n1 (scontrol show node; the name n1 does not resolve here)"
    assert (tmp_path / "scontrol.log").read_text() == "show node n1 -o\n"

    # A restarted step's rank 0 is the first of TRAINGUARD_NODES, not of Slurm's sorted list.
    restarted = slurm_env(SLURM_STEP_NODELIST="n[1,3-5]", SLURM_PROCID="2", SLURM_LOCALID="0",
                          SLURMD_NODENAME="n1", TRAINGUARD_NODES="n5,n1,n3,n4", TRAINGUARD_RESTART="1")  # fmt: skip
    found = find_master(plan_launch(cfg, restarted), cfg, env, resolves=lambda name: False)
    assert found.master_addr == "10.9.0.5"

    # --master-addr wins: nothing is looked up.
    asked.clear()
    given = LaunchConfig(job="llm", tp=2, master_addr="10.0.0.1")
    found = find_master(plan_launch(given, env), given, env, resolves=resolves)
    assert (found.master_addr, found.master_from, asked) == ("10.0.0.1", "--master-addr", [])


def test_a_master_nobody_can_resolve_keeps_its_name_and_says_what_to_do(tmp_path: Path) -> None:
    cfg = LaunchConfig(job="llm", tp=2)
    env = {**slurm_env(SLURM_STEP_NODELIST="gpu[1-4]", SLURM_JOB_NODELIST="gpu[1-6]", SLURMD_NODENAME="gpu3"),
           **fake_scontrol(tmp_path)}  # fmt: skip
    found = find_master(plan_launch(cfg, env), cfg, env, resolves=lambda name: False)
    assert found.master_addr == "gpu1"
    assert found.master_from.startswith("unresolved: rank 0's node gpu1 does not resolve here and error: ")
    assert "Node gpu1 not found" in found.master_from and found.master_from.endswith("pass --master-addr")
    # A NodeAddr that is the name itself says nothing new.
    same = find_master(
        plan_launch(cfg, env), cfg, env, resolves=lambda name: False,
        show_node=lambda name, environ: f"NodeName={name} NodeAddr={name}",
    )  # fmt: skip
    assert same.master_from.startswith("unresolved:") and "no other NodeAddr" in same.master_from
    # No scontrol at all: said, never a traceback.
    assert scontrol_show_node("n1", {"PATH": str(tmp_path / "nowhere")}) == "error: scontrol is not installed"


def test_the_launcher_logs_how_it_found_the_master(tmp_path: Path) -> None:
    # Names under .invalid never resolve (RFC 6761); the fake scontrol knows them.
    env = slurm_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURMD_NODENAME="n1.invalid",
                    SLURM_STEP_NODELIST="n[1-4].invalid", SLURM_JOB_NODELIST="n[1-6].invalid")  # fmt: skip
    env.update(fake_scontrol(tmp_path), TRAINGUARD_HOME=str(tmp_path / "home"))
    ready = tmp_path / "ready.json"
    result = CliRunner().invoke(
        launch,
        ["--job", "llm", "--tp", "2", "--no-publish", "--reporter-socket", str(tmp_path / "no.sock"),
         "--ready-file", str(ready), "--", "true"],
        env=env,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "master address 10.9.0.1: NodeAddr of n1.invalid (scontrol show node;" in result.output
    info = json.loads(ready.read_text())
    assert (info["master_addr"], info["master_from"].split(" (")[0]) == ("10.9.0.1", "NodeAddr of n1.invalid")
