"""Benchmark: fail-slow verdicts on real captures -- false evictions of healthy jobs, recall of slow ranks.

Reads the multi-round stack captures of a fixture folder (``scripts/capture_stack_fixtures.py``:
real gloo jobs, py-spy every 2.5 s; healthy jobs and jobs with one slow rank, 8 and 16 ranks,
5 and 15 rounds).  Every capture is judged as the live worker would judge one that started at
each of its rounds: the first ``fail_slow_rounds`` rounds, then more while the vote is close
(``Evidence.more_rounds``), up to ``fail_slow_max_rounds`` or the capture's length; a window
that runs past the last round wraps around to the first (the job is in a steady state, healthy
or slow, for the whole capture).  The windows of one capture overlap, so they are not
independent samples: read the rates as what the rule does on these jobs, not as a tight estimate.

Each window is judged with the straggler hint a detection would give:
* healthy jobs: no hint (an MFU dip asked for the capture), and each rank in turn as the hint
  (a false straggler alarm naming it) -- a false eviction is any fail-slow verdict;
* slow jobs: no hint, and the slow rank as the hint -- recall is a fail-slow verdict whose
  group holds the slow rank, "wrong" one whose group does not.

``--before`` adds the rule as it was (a 60% vote over 5 rounds, no chance bound, no more rounds).

``--lose-last`` adds the captures of a loaded machine, where the last round of every batch reaches
the worker after the capture's deadline (each round's dumps took 1.1-1.8 s in the demo run of
2026-11-27 18:00:16): judged as the worker does now (the lost round left out of the vote, more
rounds asked for while at most ``fail_slow_max_rounds`` are asked in all, ``Capture.extra_rounds``)
and as it did before (a lost round ended the capture with the close vote's healthy verdict).

Usage: ``python bench/fail_slow_bench.py tests/fixtures/stacks [--before] [--lose-last] [--alpha 0.01]``
(stderr: the capture being judged, captures done; stdout: the tables and ``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainguard.detectors.stacks import (  # noqa: E402 -- after the path tweak, so it runs from a checkout
    OverEvictionClassifier,
    OverEvictionConfig,
    RankState,
    load_dump_dir,
)
from trainguard.infra.progress import Progress  # noqa: E402
from trainguard.schemas.enums import Verdict  # noqa: E402
from trainguard.schemas.topology import JobTopology  # noqa: E402


@dataclass
class Tally:
    windows: int = 0
    evicted: int = 0  # healthy: false evictions; slow: evictions of the slow rank's group
    wrong: int = 0  # slow: evictions of a group without the slow rank
    undecided: int = 0  # still asking for more rounds when the recording had no more
    rounds: int = 0  # rounds used, summed (more rounds for close votes)

    def add(self, other: Tally) -> None:
        self.windows += other.windows
        self.evicted += other.evicted
        self.wrong += other.wrong
        self.undecided += other.undecided
        self.rounds += other.rounds

    def rate(self, n: int) -> str:
        return f"{n}/{self.windows} ({n / self.windows:.0%})" if self.windows else "-"


def judge(
    clf: OverEvictionClassifier, states: list[list[RankState]], start: int, hint: tuple[int, ...]
) -> tuple[Verdict, tuple[int, ...], int, bool]:
    """The live procedure from round ``start`` on (wrapping around): the first rounds, then more
    while asked; (verdict, evicted ranks, rounds used, still undecided)."""
    rotated = states[start:] + states[:start]
    res, used = clf.analyze_recorded(rotated, mode="fail_slow", hint=hint)
    return res.verdict, res.evict_ranks, used, bool(res.evidence.more_rounds)


def judge_lossy(
    clf: OverEvictionClassifier,
    states: list[list[RankState]],
    start: int,
    hint: tuple[int, ...],
    refuse: bool,
) -> tuple[Verdict, tuple[int, ...], int, bool]:
    """:func:`judge` when the last round of every batch of ``fail_slow_rounds`` is lost (after the
    deadline): the vote is over the rounds that came; a close one takes more rounds while at most
    ``fail_slow_max_rounds`` are asked in all, or (``refuse``: the rule before) none at all."""
    cfg = clf.config
    rotated = states[start:] + states[:start]
    asked = min(cfg.fail_slow_rounds, len(rotated))
    while True:
        answered = [rotated[i] for i in range(asked) if (i + 1) % cfg.fail_slow_rounds]
        res = clf.analyze_states(answered, mode="fail_slow", hint=hint)
        more = res.evidence.more_rounds
        follow = 0 if refuse else max(0, min(more, cfg.fail_slow_max_rounds - asked))
        if follow and asked < len(rotated):
            asked = min(asked + follow, len(rotated))
            continue
        return res.verdict, res.evict_ranks, len(answered), bool(follow)


def topology(manifest: dict[str, object]) -> JobTopology:
    t = manifest["topology"]
    assert isinstance(t, dict)
    world = t["tp"] * t["pp"] * t["dp"]
    machines = [f"m{i}" for i in range(world // t["ranks_per_machine"])]
    return JobTopology(
        job="bench", tp=t["tp"], pp=t["pp"], dp=t["dp"], ranks_per_machine=t["ranks_per_machine"],
        order=t["order"], machines=machines,
    )  # fmt: skip


def judge_case(
    clf: OverEvictionClassifier,
    states: list[list[RankState]],
    slow: int | None,
    hints: list[tuple[int, ...]],
    use_hints: bool,
    lossy: str = "",
) -> Tally:
    """Every window of one capture with every hint (``use_hints`` False: the rule before hints,
    judged as often, so the rates compare; ``lossy`` "now" or "was": :func:`judge_lossy`)."""
    tally = Tally()
    for start in range(len(states)):
        for hint in hints:
            h = hint if use_hints else ()
            if lossy:
                verdict, group, used, undecided = judge_lossy(clf, states, start, h, refuse=lossy == "was")
            else:
                verdict, group, used, undecided = judge(clf, states, start, h)
            fail_slow = verdict is Verdict.FAIL_SLOW
            tally.windows += 1
            tally.evicted += fail_slow and (slow is None or slow in group)
            tally.wrong += fail_slow and slow is not None and slow not in group
            tally.undecided += undecided
            tally.rounds += used
    return tally


COLUMNS = ("capture", "ranks", "rounds", "judged", "windows", "evicted", "wrong", "undecided", "mean_rounds")
WIDTHS = (30, 5, 6, 18, 7, 7, 5, 9, 11)


def run(
    folder: Path, cfg: OverEvictionConfig, label: str, use_hints: bool = True, lossy: str = ""
) -> dict[str, object]:
    rows = []
    totals = {k: Tally() for k in ("healthy_no_hint", "healthy_rank_hint", "slow_no_hint", "slow_hint")}
    cases = sorted(p for p in folder.iterdir() if (p / "manifest.json").exists())
    # On stderr, gone (or left as one line when slow) before the table is printed on stdout.
    with Progress(f"fail-slow bench: {label}", unit="captures", summary=False) as bar, bar.ticking():
        for case in bar.iter(cases):
            bar.update(detail=case.name)
            m = json.loads((case / "manifest.json").read_text())
            if int(m.get("rounds") or 1) < cfg.fail_slow_rounds:
                continue
            topo = topology(m)
            clf = OverEvictionClassifier(topo, cfg)
            states = [clf.states(r) for r in load_dump_dir(case)]
            slow = m.get("faulty_rank")
            world = topo.world_size
            kinds: dict[str, list[tuple[int, ...]]]
            if slow is None:
                kinds = {"healthy_no_hint": [()], "healthy_rank_hint": [(r,) for r in range(world)]}
            else:
                kinds = {"slow_no_hint": [()], "slow_hint": [(int(slow),)]}
            for kind, hints in kinds.items():
                tally = judge_case(clf, states, None if slow is None else int(slow), hints, use_hints, lossy)
                totals[kind].add(tally)
                values = (case.name, world, len(states), kind, tally.windows, tally.evicted, tally.wrong,
                          tally.undecided, round(tally.rounds / tally.windows, 1))  # fmt: skip
                rows.append(dict(zip(COLUMNS, values, strict=True)))
    print(f"\n== {label} ==")
    print(
        " ".join(
            f"{c:{'<' if i < 1 or i == 3 else '>'}{w}}"
            for i, (c, w) in enumerate(zip(COLUMNS, WIDTHS, strict=True))
        )
    )
    for r in rows:
        cells = [r[c] for c in COLUMNS]
        print(
            " ".join(
                f"{v!s:{'<' if i < 1 or i == 3 else '>'}{w}}"
                for i, (v, w) in enumerate(zip(cells, WIDTHS, strict=True))
            )
        )
    h, hr, s, sh = (totals[k] for k in ("healthy_no_hint", "healthy_rank_hint", "slow_no_hint", "slow_hint"))
    summary = {
        "false_evictions_healthy_no_hint": h.rate(h.evicted),
        "false_evictions_healthy_rank_hint": hr.rate(hr.evicted),
        "recall_slow_no_hint": s.rate(s.evicted),
        "recall_slow_hint": sh.rate(sh.evicted),
        "wrong_group_slow": s.wrong + sh.wrong,
        "undecided_slow_recording_too_short": s.undecided + sh.undecided,
    }
    for k, v in summary.items():
        print(f"{k:36} {v}")
    return {"label": label, "rows": rows, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fixtures", type=Path, help="folder of stack captures (tests/fixtures/stacks)")
    ap.add_argument("--alpha", type=float, default=None, help="fail_slow_alpha (default: the config's)")
    ap.add_argument("--min-vote", type=float, default=None, help="min_vote_fraction (default: the config's)")
    ap.add_argument("--before", action="store_true", help="also judge with the rule as it was")
    ap.add_argument(
        "--lose-last",
        action="store_true",
        help="also judge with every batch's last round lost, now and before",
    )
    ap.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    args = ap.parse_args()
    cfg = OverEvictionConfig()
    if args.alpha is not None:
        cfg = replace(cfg, fail_slow_alpha=args.alpha)
    if args.min_vote is not None:
        cfg = replace(cfg, min_vote_fraction=args.min_vote)
    label = (
        f"now: p <= {cfg.fail_slow_alpha:g}, vote {cfg.min_vote_fraction:g}, "
        f"up to {cfg.fail_slow_max_rounds} rounds"
    )
    out = [run(args.fixtures, cfg, label)]
    if args.before:
        before = replace(
            cfg, fail_slow_alpha=1.0, fail_slow_extend_p=0.0, fail_slow_max_rounds=cfg.fail_slow_rounds,
            min_vote_fraction=0.6,
        )  # fmt: skip
        out.append(
            run(args.fixtures, before, "before: 60% vote over 5 rounds, no chance bound, no hints", False)
        )
    if args.lose_last:
        out.append(run(args.fixtures, cfg, f"{label}; each batch's last round lost", lossy="now"))
        out.append(
            run(
                args.fixtures,
                cfg,
                f"{label}; each batch's last round lost, a lost round ends it",
                lossy="was",
            )
        )
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
