"""Over-eviction fitted to the job's shape (issue 36: a one-rank hang in a 5-node plain DDP job
evicted all 5 nodes): the table of docs/design/over-eviction.md row by row, the share threshold, and the
verdicts through the stack analysis, the Flight Recorder and a capture to the decision."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainguard.commands.stacks import COMMANDS
from trainguard.detectors.capture import Capture, rounds_from_dumps
from trainguard.detectors.decide import DecisionPolicy
from trainguard.detectors.eviction import choose_eviction, choose_group
from trainguard.detectors.flight_recorder import (
    Entry,
    FlightRecorderConfig,
    Group,
    RankDump,
    analyze_dumps,
    dump_to_event,
)
from trainguard.detectors.flight_recorder.combine import combine
from trainguard.detectors.stacks import OverEvictionClassifier, OverEvictionConfig
from trainguard.schemas.config import ConfigError, load_config
from trainguard.schemas.enums import Action, ProcessRole, Verdict
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import Frame, ProcessInfo, StackDump, ThreadStack

DOC = Path(__file__).resolve().parents[2] / "docs" / "design" / "over-eviction.md"
PREF = ("pp", "tp", "dp")
SHARE = OverEvictionConfig().max_group_share

# -- the doc's table ----------------------------------------------------------------------------


def _table_rows() -> list[list[str]]:
    """The rows of the doc's "Job shapes" table, cells stripped."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| Job shape |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


ROWS = _table_rows()


def _machines(ms: tuple[int, ...]) -> str:
    return ("machine " if len(ms) == 1 else "machines ") + ", ".join(map(str, ms))


def test_the_table_has_every_shape_the_doc_promises() -> None:
    shapes = " / ".join(r[0] for r in ROWS)
    promised = ("pure DDP", "TP=8 within a machine", "TP8 x PP4 on 4", "PP across 2 machines")
    for shape in (*promised, "2-machine", "1-machine"):
        assert shape in shapes
    assert all(len(r) == 9 for r in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_each_row_of_the_doc_is_what_the_code_evicts(row: list[str]) -> None:
    _shape, tp, pp, dp, per_machine, machines, suspect, group, evicted = row
    topo = JobTopology(job="j", tp=int(tp), pp=int(pp), dp=int(dp), ranks_per_machine=int(per_machine))
    assert topo.num_machines == int(machines)
    kind, ranks = choose_group(topo, [int(suspect)], PREF)
    assert group == f"{kind}, {len(topo.machines_of(list(ranks)))} of {topo.num_machines} machines"
    ev = choose_eviction(topo, [int(suspect)], PREF, SHARE)
    if ev.kind is None:
        assert evicted == "nothing: restart in place"
    elif ev.kind == "machine":
        assert evicted == _machines(ev.machines)
    else:
        assert evicted == f"{ev.kind} group: {_machines(ev.machines)}"
    # Never the whole job; the suspect always goes with what is evicted.
    assert len(ev.machines) < topo.num_machines
    assert not ev.ranks or int(suspect) in ev.ranks


def test_the_docs_default_is_the_configs() -> None:
    assert SHARE == FlightRecorderConfig().max_group_share == 0.5
    assert re.search(r"`aggregation\.over_eviction\.max_group_share` \| 0\.5 \|", DOC.read_text())


# -- the rule -----------------------------------------------------------------------------------

DDP5 = JobTopology(job="ddp", tp=1, pp=1, dp=40, ranks_per_machine=8, machines=[f"n{i}" for i in range(5)])


def test_a_pure_ddp_suspect_evicts_its_machine_and_says_which_group_it_spared() -> None:
    ev = choose_eviction(DDP5, [9], PREF, SHARE)
    assert (ev.kind, ev.machines, ev.ranks) == ("machine", (1,), tuple(range(8, 16)))
    assert (
        ev.not_evicted is not None
        and ev.not_evicted.kind == "dp"
        and ev.not_evicted.ranks == tuple(range(40))
    )
    assert "every machine of the job (5 of 5)" in ev.why and "[1]" in ev.why


def test_two_suspects_on_two_machines_of_a_ddp_job_evict_those_two_machines() -> None:
    ev = choose_eviction(DDP5, [3, 33], PREF, SHARE)
    assert (ev.kind, ev.machines) == ("machine", (0, 4))
    assert ev.ranks == (*range(0, 8), *range(32, 40))
    # Even three of five: the suspects' machines are what the verdict singles out.
    assert choose_eviction(DDP5, [3, 20, 33], PREF, SHARE).machines == (0, 2, 4)


def test_suspects_on_every_machine_evict_nothing() -> None:
    ev = choose_eviction(DDP5, [0, 8, 16, 24, 32], PREF, SHARE)
    assert (ev.kind, ev.ranks, ev.machines) == (None, (), ())
    assert ev.not_evicted is not None and "nothing is evicted" in ev.why


def test_tp_and_pp_groups_still_over_evict() -> None:
    # TP8 within a machine: the TP group is the machine.
    tp8 = JobTopology(job="tp", tp=8, dp=4, ranks_per_machine=8)
    ev = choose_eviction(tp8, [9], PREF, SHARE)
    assert (ev.kind, ev.ranks, ev.machines, ev.why, ev.not_evicted) == (
        "tp",
        tuple(range(8, 16)),
        (1,),
        "",
        None,
    )
    # TP2 x PP4 x DP4, 2 GPUs a machine (ByteRobust Fig. 7): the pipeline of rank 30, 4 of 16 machines.
    fig7 = JobTopology(job="fig7", tp=2, pp=4, dp=4, ranks_per_machine=2)
    ev = choose_eviction(fig7, [30], PREF, SHARE)
    assert (ev.kind, ev.ranks, ev.machines, ev.why) == ("pp", (6, 14, 22, 30), (3, 7, 11, 15), "")


def test_the_share_threshold() -> None:
    # The pipeline of rank 9 in TP8 x PP2 x DP2 spans machines 1 and 3 of 4: half the job.
    topo = JobTopology(job="j", tp=8, pp=2, dp=2, ranks_per_machine=8)
    assert choose_eviction(topo, [9], PREF, 0.5).kind == "pp"  # at the share: still evicted
    narrowed = choose_eviction(topo, [9], PREF, 0.49)
    assert (narrowed.kind, narrowed.machines) == ("machine", (1,))
    assert "spans 2 of the job's 4 machines, more than max_group_share 0.49" in narrowed.why
    assert choose_eviction(topo, [9], PREF, 0.0).kind == "machine"
    # A share of 1.0 allows any group but the whole job.
    whole = JobTopology(job="w", tp=8, pp=4, ranks_per_machine=8)
    assert choose_eviction(whole, [9], PREF, 1.0).kind == "machine"


def test_the_share_is_configuration_with_bounds() -> None:
    assert load_config(OverEvictionConfig, {"max_group_share": 0.25}).max_group_share == 0.25
    assert load_config(FlightRecorderConfig, {"max_group_share": 1.0}).max_group_share == 1.0
    for cls in (OverEvictionConfig, FlightRecorderConfig):
        with pytest.raises(ConfigError, match="above the maximum"):
            load_config(cls, {"max_group_share": 1.5})
        with pytest.raises(ConfigError, match="below the minimum"):
            load_config(cls, {"max_group_share": -0.1})


# -- through the analyses -----------------------------------------------------------------------

C10D = "torch/distributed/distributed_c10d.py"
IN_ALL_REDUCE = [
    Frame("all_reduce", C10D, 2000),
    Frame("_sync_buckets", "torch/nn/parallel/distributed.py", 10),
    Frame("train_step", "train.py", 5),
]
COMPUTING = [Frame("forward", "model.py", 30), Frame("train_step", "train.py", 4)]


def _capture(topo: JobTopology, stack_of: dict[int, list[Frame] | None]) -> Capture:
    """A hang's capture (no Flight Recorder) with these main-process stacks (None: no dump)."""
    cap = Capture("c1", topo.job, topo, rounds=1, deadline_ms=10, requested_ms=0)
    for rank in range(topo.world_size):
        frames = stack_of.get(rank, IN_ALL_REDUCE)
        if frames is None:
            continue  # e.g. a process in state T that py-spy cannot attach to
        cap.add(
            StackDump(
                job=topo.job, node=topo.machine_name(topo.machine_of(rank)), rank=rank, pid=100 + rank,
                capture_id="c1", ts_ms=0, role=ProcessRole.MAIN, process_tree=[ProcessInfo(pid=100 + rank)],
                threads=[ThreadStack(thread_id=1, name="MainThread", frames=frames)],
            )
        )  # fmt: skip
    return cap


def test_the_user_trial_a_one_rank_hang_in_pure_ddp_evicts_one_machine() -> None:
    # 5 nodes, tp = pp = 1: rank 9 stopped (no dump), every other rank in its DDP all-reduce.
    det = _capture(DDP5, {9: None}).analyze(1_000)
    assert det.action is Action.EVICT and det.ranks == [9]
    evict = det.evidence["evict"]
    assert (evict["kind"], evict["machines"], evict["machine_names"]) == ("machine", [1], ["n1"])
    assert evict["not_evicted"]["kind"] == "dp" and "spans every machine" in evict["why"]
    assert "evict machine(s) n1" in det.message
    dec = DecisionPolicy().decide(det, 1_001, DDP5)
    assert dec is not None and dec.action is Action.EVICT
    assert (dec.targets.machines, dec.targets.group_kind) == (["n1"], "machine")
    assert dec.evidence["analysis"]["evict"]["why"] == evict["why"]


def test_a_one_machine_hang_restarts_in_place() -> None:
    one = JobTopology(job="one", tp=8, ranks_per_machine=8, machines=["n0"])
    det = _capture(one, {3: None}).analyze(1_000)
    assert det.evidence["verdict"] == "hang" and det.ranks == [3]
    assert det.action is Action.RESTART and det.category == "job_hang"
    assert det.evidence["evict"]["kind"] is None and "nothing is evicted" in det.evidence["evict"]["why"]
    assert det.message.startswith("hang: restart in place")
    dec = DecisionPolicy().decide(det, 1_001, one)
    assert dec is not None and dec.action is Action.RESTART
    assert (dec.targets.machines, dec.targets.group_kind) == ([], "job")


S = 1_000_000_000
NOW = 100 * S


def _all_reduce(seq: int, state: str) -> Entry:
    """All-reduce ``seq`` of the default group, entered 25 s before the dumps."""
    return Entry(seq, "0", seq, False, "gloo:all_reduce", state, ((4,),), ((4,),), NOW - 25 * S, None)


def _recorders(topo: JobTopology, entries: dict[int, tuple[Entry, ...]]) -> dict[int, RankDump]:
    everyone = {"0": Group("0", "default_pg", tuple(range(topo.world_size)))}
    return {r: RankDump(r, "2.10", everyone, entries[r], f"rank{r}") for r in range(topo.world_size)}


def _stuck_everywhere(topo: JobTopology) -> dict[int, RankDump]:
    """Every rank inside all_reduce #3, none done: the Flight Recorder's "the group itself is
    suspect" (a link, or a rank failing inside the collective)."""
    return _recorders(topo, {r: (_all_reduce(3, "started"),) for r in range(topo.world_size)})


def _fr_capture(
    topo: JobTopology, dumps: dict[int, RankDump], stacks: dict[int, list[Frame] | None]
) -> Capture:
    cap = _capture(topo, stacks)
    cap.flight_recorder = True
    for rank, d in dumps.items():
        node = topo.machine_name(topo.machine_of(rank))
        cap.add_fr(dump_to_event(d, job=topo.job, node=node, ts_ms=NOW // 1_000_000, capture_id="c1"))
    return cap


def test_two_ranks_hung_on_two_machines_of_a_ddp_job_through_a_capture() -> None:
    # Ranks 3 and 33 never entered all_reduce #3; the other 38 wait in it.  (The stacks alone
    # call two busy ranks of different DP replicas ordinary overlap; the recorder shows the wait.)
    done, waiting = _all_reduce(2, "completed"), _all_reduce(3, "started")
    dumps = _recorders(
        DDP5, {r: (done,) if r in (3, 33) else (done, waiting) for r in range(DDP5.world_size)}
    )
    det = _fr_capture(DDP5, dumps, {3: COMPUTING, 33: COMPUTING}).analyze(1_000)
    assert det.action is Action.EVICT and det.ranks == [3, 33]
    evict = det.evidence["evict"]
    assert (evict["kind"], evict["machine_names"]) == ("machine", ["n0", "n4"])
    assert evict["ranks"] == [*range(0, 8), *range(32, 40)] and evict["not_evicted"]["kind"] == "dp"


def test_a_recorder_that_suspects_the_whole_job_evicts_nothing_and_the_hang_restarts() -> None:
    topo = JobTopology(job="ddp", dp=4, ranks_per_machine=1, machines=["n0", "n1", "n2", "n3"])
    dumps = _stuck_everywhere(topo)
    fr = analyze_dumps(dumps, topo, {r: NOW for r in dumps})
    # Before issue 36 this evicted the DP group: all four machines.
    assert fr.verdict == "hang" and fr.suspect_ranks == (0, 1, 2, 3)
    assert (fr.evict_kind, fr.evict_ranks) == (None, ()) and fr.not_evicted is not None
    # The stacks see every rank in the same all-reduce: no rank stands out.
    det = _fr_capture(topo, dumps, {}).analyze(1_000)
    assert det.evidence["stacks"]["verdict"] == "healthy"
    assert det.evidence["verdict"] == "hang" and det.evidence["decided_by"] == "flight_recorder"
    assert det.action is Action.RESTART and det.evidence["evict"]["machines"] == []
    assert det.evidence["evict"]["not_evicted"] == {"kind": "dp", "ranks": [0, 1, 2, 3]}


def test_the_recorder_alone_restarts_only_after_the_full_wait() -> None:
    topo = JobTopology(job="ddp", dp=4, ranks_per_machine=1, machines=["n0", "n1", "n2", "n3"])
    dumps = _stuck_everywhere(topo)
    fr = analyze_dumps(dumps, topo, {r: NOW for r in dumps})
    stacks = OverEvictionClassifier(topo).analyze(rounds_from_dumps(_capture(topo, {}).dumps, 1))
    assert stacks.verdict is Verdict.HEALTHY
    early = combine(stacks, fr, topo, PREF, alone_min_stuck_s=30.0)
    assert early.verdict is Verdict.HEALTHY and "waits for more" in early.reason
    late = combine(stacks, fr, topo, PREF, alone_min_stuck_s=3.0)
    assert (late.verdict, late.evict_ranks, late.decided_by) == (Verdict.HANG, (), "flight_recorder")
    assert late.not_evicted is not None and late.evict_why == fr.evict_why


def test_the_command_line_says_what_was_not_evicted() -> None:
    # A recorded hang of tp1pp4dp2, 2 GPUs a machine: each pipeline runs over all 4 machines.
    case = Path(__file__).resolve().parents[1] / "fixtures" / "stacks" / "tp1pp4dp2_compute_hang_middle_stage"
    shape = ["--tp", "1", "--pp", "4", "--dp", "2", "--ranks-per-machine", "2"]
    res = CliRunner().invoke(COMMANDS[0], ["analyze", str(case), *shape])
    assert res.exit_code == 0, res.output
    assert "evict: the suspects' machine(s) [" in res.output
    assert (
        "not evicted: the pp group" in res.output and "spans every machine of the job (4 of 4)" in res.output
    )
