"""The fail-slow capture of a real demo run whose "more rounds" were refused, replayed on its
recorded timeline (``tests/fixtures/captures/slow-refused-20261127-180016.yaml``, which cites the
run's logs line by line).

In that run the slow rank's first 5 rounds were a close vote, the worker asked for rounds 5-9,
and on a loaded machine each round's dumps took 1.1-1.8 s: the last round reached the worker
after the deadline (8 s + 5 intervals of 2 s, dump time not counted).  Judged on rounds 0-8 the
vote was still close ("rank(s) [4] slowest in 5/9 rounds ... p = 0.127 ... 5 more round(s)"),
but ``Capture.may_extend()`` asked every round to be answered, refused, and the capture ended
healthy: the slow rank was never localised.

The stacks are the demo's own (``tests/fixtures/incidents/slow.jsonl``: rank 4 computing in
``run_rank`` while the others wait in ``all_reduce``), arranged per round as the fixture's roots say.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from trainguard.detectors.replay import ReplayConfig, decode_records
from trainguard.detectors.routing import CAPTURE_TICK_S, DetectionPath
from trainguard.detectors.stacks.significance import chance_p_value
from trainguard.infra.replay import read_recording
from trainguard.schemas.control import Command, Decision, Detection
from trainguard.schemas.enums import Action, ProcessRole
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import StackDump, ThreadStack

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REC: dict[str, Any] = yaml.safe_load(
    (FIXTURES / "captures" / "slow-refused-20261127-180016.yaml").read_text()
)
T0: int = REC["requested_ms"]
JOB = REC["run"]
TOPO = JobTopology(job=JOB, **REC["topology"])
AGG: dict[str, float] = REC["aggregation"]
INTERVAL_MS = int(AGG["fail_slow_interval_s"] * 1000)
TICK_MS = int(CAPTURE_TICK_S * 1000)


def _templates() -> tuple[list[StackDump], list[ThreadStack], list[ThreadStack]]:
    """One round of the demo's recorded slow incident: its dumps (main processes and their
    DataLoader workers), a computing rank's threads and a waiting rank's."""
    events, rejected = decode_records(read_recording(FIXTURES / "incidents" / "slow.jsonl"))
    assert not rejected
    dumps = [ev for _, ev in events if isinstance(ev, StackDump) and ev.round == 0]
    mains = {d.rank: d for d in dumps if d.role is ProcessRole.MAIN}
    assert sorted(mains) == list(range(TOPO.world_size))
    return dumps, list(mains[4].threads), list(mains[0].threads)  # rank 4 computes, rank 0 waits


TEMPLATES, COMPUTE, WAITING = _templates()


def _took_s(node: str, rnd: int) -> float:
    took = REC["took_s"]
    if took[node] == "median":  # no log of its own: the median of the logged machines
        return statistics.median(_took_s(n, rnd) for n, v in took.items() if v != "median")
    value = took[node][rnd] if rnd < len(took[node]) else took[node][5 + (rnd - 5) % 5]
    return float(REC["unlogged_took_s"] if value is None else value)


@dataclass
class Replay:
    """The worker's aggregation stage on the recorded clock: the exporters answer each batch of
    rounds as the run's did, the timer ticks every ``CAPTURE_TICK_S``, a complete capture is
    judged at once (as ``streams/agents/aggregation.py`` does)."""

    roots: list[list[int]]
    lost: set[int] = field(default_factory=set)  # rounds whose dumps never reach the worker
    path: DetectionPath = field(default_factory=lambda: DetectionPath(ReplayConfig.from_worker_section(REC)))
    arrivals: list[tuple[int, StackDump]] = field(default_factory=list)
    asked: list[tuple[int, int, int]] = field(default_factory=list)  # (at, first round, rounds)
    reached: dict[tuple[int, str], int] = field(default_factory=dict)  # (round, machine) -> when
    judged: list[tuple[int, Detection]] = field(default_factory=list)
    verdict: Detection | None = None

    def __post_init__(self) -> None:
        # ReplayConfig.from_worker_section keeps the keys it knows: the aggregation section.
        assert self.path.config.aggregation.deadline_s == AGG["deadline_s"]

    def start(self) -> str:
        d = REC["decision"]
        dec = Decision(
            decision_id=d["decision_id"], ts_ms=T0, job=JOB, action=Action.AGGREGATE,
            evidence={"detection": {"kind": d["kind"], "category": d["category"], "ranks": d["ranks"],
                                    "source_ts_ms": d["source_ts_ms"]}},
        )  # fmt: skip
        assert self.path.wants_capture(dec, T0)
        cmds = [c for c in self.path.start_capture(dec, TOPO, T0) if isinstance(c, Command)]
        self._answer(cmds, T0)
        return str(cmds[0].args["capture_id"])

    def _answer(self, cmds: list[Command], at: int) -> None:
        """The exporters' dumps for ``cmds`` (sent at ``at``), with when each reaches the worker."""
        first, rounds = int(cmds[0].args.get("first_round", 0)), int(cmds[0].args["rounds"])
        self.asked.append((at, first, rounds))
        batch = len(self.asked) - 1
        delay_s = REC["command_delay_s"][min(batch, len(REC["command_delay_s"]) - 1)]
        for cmd in cmds:
            t = at + int(delay_s * 1000)
            for rnd in range(first, first + rounds):
                if rnd > 0:  # every round but a capture's very first waits an interval
                    t += INTERVAL_MS
                t += int(_took_s(cmd.node, rnd) * 1000)
                if rnd in self.lost:
                    continue
                self.reached[rnd, cmd.node] = t + REC["worker_lag_ms"]
                for dump in self._dumps(cmd, rnd, t):
                    self.arrivals.append((t + REC["worker_lag_ms"], dump))
        self.arrivals.sort(key=lambda a: a[0])

    def _dumps(self, cmd: Command, rnd: int, ts_ms: int) -> list[StackDump]:
        busy = self.roots[rnd] if rnd < len(self.roots) else [REC["slow_rank"]]
        machine = TOPO.machines.index(cmd.node)
        out = []
        for d in TEMPLATES:
            if d.rank // TOPO.ranks_per_machine != machine:
                continue
            threads = d.threads
            if d.role is ProcessRole.MAIN:
                threads = COMPUTE if d.rank in busy else WAITING
            out.append(
                replace(d, job=JOB, node=cmd.node, capture_id=str(cmd.args["capture_id"]), round=rnd,
                        ts_ms=ts_ms, threads=threads)
            )  # fmt: skip
        return out

    def run(self, until_ms: int = 120_000) -> Detection:
        """Until a verdict is emitted (the capture judged and not extended)."""
        now = T0
        while self.verdict is None and now < T0 + until_ms:
            now += 100
            while self.arrivals and self.arrivals[0][0] <= now:
                _, dump = self.arrivals.pop(0)
                if self.path.add_dump(dump) and self.path.capture_complete(dump):
                    self._close(now)
            if (now - T0) % TICK_MS == 0:
                self._close(now)
        assert self.verdict is not None, f"no verdict in {until_ms} ms"
        return self.verdict

    def _close(self, now: int) -> None:
        for cap in self.path.due_captures(now):
            det = self.path.analyze(cap, now)
            self.judged.append((now - T0, det))
            more = self.path.extend_capture(cap, det, now)
            if more:
                self._answer(more, now)
            else:
                self.verdict = det


def _reason(det: Detection) -> str:
    return str(det.evidence["evidence"]["reason"])


def test_the_fixture_is_the_recorded_capture() -> None:
    """The decision's id names the capture the run's logs name; the roots give the recorded vote."""
    rep = Replay(REC["roots"])
    assert rep.start() == REC["capture_id"]
    shares = [len(r) / TOPO.world_size for r in REC["roots"][:9]]
    assert round(chance_p_value(5, shares, TOPO.world_size), 3) == REC["recorded_p"]


def test_a_round_lost_after_the_deadline_no_longer_refuses_the_more_rounds() -> None:
    """Round 9 never reaches the worker in time (as in the run): the vote on rounds 0-8 is the
    recorded one, and its 5 more rounds are asked for -- the run's worker refused them."""
    rep = Replay(REC["roots"], lost={9})
    rep.start()
    det = rep.run()
    (at0, first), (_, second) = rep.judged[:2]
    # Rounds 0-4: complete and judged by the time the run's worker logged it, close (p = 0.44).
    assert at0 <= REC["judged_ms"]["first"] and "5 more rounds asked for" in first.message, first.message
    # Rounds 0-8 (9 lost): the recorded vote.
    assert REC["recorded_vote"] in _reason(second), _reason(second)
    assert f"chance p = {REC['recorded_p']:.3g} for any of the 8 ranks" in _reason(second)
    assert "5 more round(s) decide it" in _reason(second)
    assert second.evidence["evidence"]["rounds"] == 9
    assert "5 more rounds asked for" in second.message, second.message  # the run's worker: none
    assert [(first_round, n) for _, first_round, n in rep.asked] == [(0, 5), (5, 5), (10, 5)]
    # Rounds 10-14 came (the slow rank alone in each): rank 4's pipeline group goes.
    assert det.action is Action.EVICT and det.category == "fail_slow", det.message
    assert det.evidence["evict"]["machine_names"] == ["standby-init-0", "m2"]
    assert det.evidence["evidence"]["rounds"] == 14  # 15 asked, round 9 lost
    assert det.evidence["evidence"]["p_value"] <= 0.01


def test_the_more_rounds_deadline_follows_the_exporters_pace() -> None:
    """The recorded round times: 5 rounds at 2 s intervals took 17.9-18.4 s to reach the worker
    (the run's deadline: 18 s).  The new rounds' deadline counts what a round took in the batch
    before (about 3 s), so round 9 is in, the vote is over 10 rounds, and the slow rank is found."""
    rep = Replay(REC["roots"])
    rep.start()
    det = rep.run()
    extended_at = rep.asked[1][0]
    assert extended_at - T0 <= REC["judged_ms"]["first"]  # as the run's worker logged it
    # Round 9 reached the worker after the run's deadline on every machine (so it had no dump at
    # all when the capture was judged: the recorded "5/9"), and before the one the pace gives.
    run_deadline = extended_at + int((AGG["deadline_s"] + 5 * AGG["fail_slow_interval_s"]) * 1000)
    late = {node: rep.reached[9, node] - run_deadline for node in TOPO.machines}
    assert min(late.values()) > 0, late
    at1, second = rep.judged[1]
    assert second.evidence["evidence"]["rounds"] == 10, second.message
    assert T0 + at1 < run_deadline + 1_500, (at1, run_deadline - T0)  # judged when complete
    assert det.action is Action.EVICT and det.evidence["evict"]["machine_names"] == ["standby-init-0", "m2"]
    assert det.evidence["evidence"]["p_value"] <= 0.01


def test_a_batch_nobody_answers_still_ends_the_capture_as_it_was() -> None:
    """Rounds 5-9 all lost: the exporters did not answer, no more rounds are asked, the verdict on
    rounds 0-4 stands (healthy, and it says why no more rounds came)."""
    rep = Replay(REC["roots"], lost={5, 6, 7, 8, 9})
    rep.start()
    det = rep.run()
    assert det.action is Action.NONE and det.evidence["evidence"]["rounds"] == 5
    assert "no round of 5-9 was answered" in det.message, det.message
    assert [(f, n) for _, f, n in rep.asked] == [(0, 5), (5, 5)]


def test_more_rounds_stop_at_fail_slow_max_rounds_however_many_are_lost() -> None:
    """A vote that stays close while every batch loses its last round: rounds are asked for up to
    ``fail_slow_max_rounds`` (15) in all -- three looks, the ones its significance is spent over --
    and the verdict is healthy."""
    noise = [[0, 4], [1], [4, 5], [6], [1, 4]] * 3  # rank 4 a root in 3 of 5 rounds, throughout
    rep = Replay(noise, lost={9, 14})
    rep.start()
    det = rep.run()
    assert [(f, n) for _, f, n in rep.asked] == [(0, 5), (5, 5), (10, 5)]
    # 7 of 13 rounds: p = 0.039, close, 2 more asked by the vote; none follow.
    assert det.action is Action.NONE and det.evidence["evidence"]["rounds"] == 13
    assert det.evidence["evidence"]["more_rounds"] == 2
    assert "15 rounds asked for, the most one capture takes" in det.message, det.message


def test_a_round_lost_in_the_middle_does_not_hide_the_rounds_after_it() -> None:
    rep = Replay(REC["roots"], lost={9})
    rep.start()
    rep.run()
    last = rep.judged[-1][1]
    assert last.evidence["evidence"]["rounds"] == 14  # rounds 0-8 and 10-14, not 0-8 alone
