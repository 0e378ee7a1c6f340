"""The over-eviction classifier: rounds of per-rank stacks -> verdict and the group to evict.

* **Hang** (one round, or several rounds in which the stacks did not move): the wait-for
  analysis of the last round names the root rank(s); the parallel group holding them is evicted.
* **Fail-slow** (several rounds whose stacks moved; ByteRobust samples every 10 s): each round
  whose analysis is confident flags the group holding its roots; the rank found as the root
  most often is the suspect, and its group is evicted if it was flagged in enough rounds *and*
  the vote is beyond chance (:mod:`trainguard.detectors.stacks.significance`: a healthy job's captures
  find roots too, wherever ranks happen to be).  A close vote asks for more rounds
  (``Evidence.more_rounds``); a vote for a rank the triggering straggler signal named
  (``hint``) needs less evidence than one for any rank.
* Otherwise the job is **healthy** and nothing is evicted.

The evicted group is the first kind in ``evict_preference`` (default PP, then TP, then DP)
that has one group holding every root; when no single group does, the group holding the most
roots.  A group spanning every machine of the job (pure DDP) or more than ``max_group_share``
of them is not evicted: only the suspects' own machines are, or nothing when they are on every
machine (:func:`~trainguard.detectors.eviction.choose_eviction`).  Machines are
``rank // ranks_per_machine``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from trainguard.detectors.eviction import Eviction, choose_eviction, choose_group, preference_order
from trainguard.detectors.stacks.analysis import RankState, RoundAnalysis, analyze_round, rank_states
from trainguard.detectors.stacks.config import OverEvictionConfig
from trainguard.detectors.stacks.loader import Round
from trainguard.detectors.stacks.patterns import PatternTable, Role
from trainguard.detectors.stacks.result import Evidence, OverEvictionResult, StackClass, Vote
from trainguard.detectors.stacks.roles import StackReader
from trainguard.detectors.stacks.significance import chance_p_value
from trainguard.schemas.enums import Verdict
from trainguard.schemas.topology import Dim, JobTopology

MODES = ("auto", "hang", "fail_slow")
#: the round causes that are a fail-slow vote: a rank busy while the others wait on it (or
#: without a dump); collective skew in a moving job is not one (see ``_fail_slow``).
VOTING_CAUSES = ("busy", "missing")


class OverEvictionClassifier:
    """Analyses stack rounds of one job with a fixed topology, config and pattern table."""

    def __init__(
        self,
        topology: JobTopology,
        config: OverEvictionConfig | None = None,
        patterns: PatternTable | None = None,
    ) -> None:
        self.topology = topology
        self.config = config or OverEvictionConfig()
        self.reader = StackReader(patterns, self.config.evidence_frames)
        self._preference: list[Dim] = preference_order(self.config.evict_preference)

    def states(self, round_: Round) -> list[RankState]:
        return rank_states(round_, self.topology.world_size, self.reader)

    def analyze(
        self, rounds: Sequence[Round], mode: str = "auto", hint: Sequence[int] = ()
    ) -> OverEvictionResult:
        """Verdict for these rounds.

        ``mode``: ``auto`` (one round, or rounds whose stacks did not move -> hang analysis;
        otherwise fail-slow voting), ``hang`` or ``fail_slow`` to force one procedure.
        ``hint``: ranks the signal that asked for the capture named (a straggler detection's).
        """
        if not rounds:
            raise ValueError("no rounds of stacks to analyse")
        return self.analyze_states([self.states(r) for r in rounds], mode, hint)

    def analyze_states(
        self, rounds: Sequence[list[RankState]], mode: str = "auto", hint: Sequence[int] = ()
    ) -> OverEvictionResult:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        if not rounds:
            raise ValueError("no rounds of stacks to analyse")
        world = self.topology.world_size
        bad = [r for r in hint if not 0 <= r < world]
        if bad:
            raise ValueError(f"hint ranks {bad} outside the job's {world} ranks")
        if mode == "hang" or (mode == "auto" and (len(rounds) == 1 or self._frozen(rounds))):
            return self._hang(rounds)
        return self._fail_slow(rounds[-self.config.fail_slow_max_rounds :], tuple(sorted(set(hint))))

    def analyze_recorded(
        self, rounds: Sequence[list[RankState]], mode: str = "auto", hint: Sequence[int] = ()
    ) -> tuple[OverEvictionResult, int]:
        """Judge a recording of more rounds than a capture starts with as the worker judges a live
        capture: the first ``fail_slow_rounds``, then more of them while the vote is close (as
        :meth:`~trainguard.detectors.capture.Captures.extend` asks the exporters).  (verdict, rounds used);
        the verdict may still ask for more rounds when the recording has no more."""
        n = min(self.config.fail_slow_rounds, len(rounds))
        while True:
            res = self.analyze_states(rounds[:n], mode, hint)
            more = res.evidence.more_rounds
            if not more or n >= len(rounds):
                return res, n
            n = min(n + more, len(rounds))

    # -- procedures -----------------------------------------------------------------------------

    def _frozen(self, rounds: Sequence[list[RankState]]) -> bool:
        """True when (almost) no rank's stack changed across the rounds: no progress, a hang."""
        first = rounds[0]
        changed = sum(
            1 for r, st in enumerate(first) if any(rs[r].signature != st.signature for rs in rounds[1:])
        )
        allowed = max(1, math.floor(self.config.hang_max_changed_fraction * len(first)))
        return changed <= allowed

    def _hang(self, rounds: Sequence[list[RankState]]) -> OverEvictionResult:
        states = rounds[-1]
        ra = analyze_round(states, self.topology, self.config)
        if not ra.confident:
            return self._healthy(states, ra, "hang", len(rounds))
        eviction = self.choose_eviction(ra.roots)
        reason = f"{ra.reach}/{ra.world} ranks wait on rank(s) {_short(ra.roots)} ({self._why(states, ra)})"
        return self._result(Verdict.HANG, ra.roots, eviction, states, ra, "hang", len(rounds), reason)

    def _fail_slow(self, rounds: Sequence[list[RankState]], hint: tuple[int, ...] = ()) -> OverEvictionResult:
        """Vote over rounds: the ranks most often found as roots, then the group holding them.

        Rounds are sampled from a job that still moves, and py-spy dumps of different ranks are
        not simultaneous, so one round's roots are noisy: a TP peer computing next to the
        straggler, or a rank already in the next step.  Counting roots per rank over the rounds
        and then requiring the chosen group to be hit in enough rounds is robust to that noise;
        the chance p-value keeps a healthy job's momentary roots from winning the vote.
        """
        cfg = self.config
        world = self.topology.world_size
        analyses = [analyze_round(states, self.topology, cfg) for states in rounds]
        # In a job that still moves, a round whose roots are ranks inside collectives (a "stuck"
        # collective or a p2p cycle caught mid-flight) is skew between dumps taken at different
        # instants, not a straggler's signature: it casts no vote.  Counting it gave its 2-4
        # roots a share of the round that pushed a real straggler's vote (rank 4 busy in 3 of
        # 5 rounds of demo run 20261127-234524) to p = 0.5-1, so no more rounds were asked.
        voting = [ra.confident and ra.cause in VOTING_CAUSES for ra in analyses]
        confident = [ra for ra, v in zip(analyses, voting, strict=True) if v]
        root_counts = Counter(r for ra in confident for r in ra.roots)
        flagged = Counter(self.choose_group(ra.roots) for ra in confident)
        votes = tuple(Vote(k, g, c) for (k, g), c in flagged.most_common())
        need = max(1, math.ceil(cfg.min_vote_fraction * len(rounds)))
        p_value: float | None = None
        more = 0
        if root_counts:
            top = max(root_counts.values())
            suspects = tuple(sorted(r for r, c in root_counts.items() if c == top))
            # In a healthy job a round's roots are whichever ranks were busy: a given rank is one
            # with probability |roots| / world.  The straggler signal's ranks were named before
            # the capture, so a vote for one of them is tested alone (and only they are the
            # suspects then: a tied unhinted rank must not ride on their weaker bar); any other
            # rank competes with every rank of the job.
            agreed = bool(hint) and not set(suspects).isdisjoint(hint)
            if agreed:
                suspects = tuple(r for r in suspects if r in hint)
            kind, group = self.choose_group(suspects)
            members = set(group)
            hits = [i for i, ra in enumerate(analyses) if voting[i] and members.intersection(ra.roots)]
            candidates = len(hint) if agreed else world
            shares = [len(ra.roots) / world if voting[i] else 0.0 for i, ra in enumerate(analyses)]
            p_value = chance_p_value(top, shares, candidates)
            alpha = self._alpha_per_test(bool(hint))
            # A straggler is the same rank again and again (real captures show it as the root in
            # 2 of 5 rounds); roots that wander between the members of a group, each found once
            # (ranks momentarily busy on shared, contended CPUs), are noise.
            voted = top >= min(2, need) and len(hits) >= need
            if voted and p_value <= alpha:
                last = hits[-1]
                ra = analyses[last]
                reason = (
                    f"rank(s) {_short(suspects)} slowest in {top}/{len(rounds)} rounds; their {kind} group "
                    f"held the roots in {len(hits)}/{len(rounds)} rounds (need {need}); "
                    f"{_chance(p_value, candidates, agreed)}; last: "
                    f"{ra.reach}/{ra.world} ranks waiting on {_short(ra.roots)} "
                    f"({self._why(rounds[last], ra)})"
                )
                # The vote is over the group (roots wander within it); what it evicts fits the job.
                res = self._result(
                    Verdict.FAIL_SLOW,
                    suspects,
                    self.choose_eviction(suspects),
                    rounds[last],
                    ra,
                    "fail_slow",
                    len(rounds),
                    reason,
                    votes,
                )
                return replace(res, evidence=replace(res.evidence, p_value=p_value, hint=hint))
            if p_value <= cfg.fail_slow_extend_p and len(rounds) < cfg.fail_slow_max_rounds:
                more = min(cfg.fail_slow_rounds, cfg.fail_slow_max_rounds - len(rounds))
            short = [] if voted else [f"too few rounds for the group (need {need})"]
            if p_value > alpha:
                short.append(f"not beyond chance (need p <= {alpha:.3g})")
            reason = (
                f"rank(s) {_short(suspects)} slowest in {top}/{len(rounds)} rounds, their {kind} group "
                f"held the roots in {len(hits)}/{len(rounds)} rounds; "
                f"{_chance(p_value, candidates, agreed)}: "
                + " and ".join(short)
                + (f"; {more} more round(s) decide it" if more else "")
            )
        else:
            reason = f"no round of {len(rounds)} had a clear root"
        best = max(analyses, key=lambda a: a.reach)
        res = self._healthy(rounds[-1], best, "fail_slow", len(rounds), votes=votes)
        evidence = replace(res.evidence, reason=reason, p_value=p_value, hint=hint, more_rounds=more)
        return replace(res, evidence=evidence)

    # -- helpers --------------------------------------------------------------------------------

    def _alpha_per_test(self, hinted: bool) -> float:
        """``fail_slow_alpha`` spent over every test one capture may run: a look after each batch
        of rounds (5, 10, 15: three by default) and, with a hint, the hinted ranks' test besides
        the all-ranks one -- so a healthy capture is evicted with probability at most
        ``fail_slow_alpha`` under the null however it goes (Bonferroni)."""
        cfg = self.config
        looks = math.ceil(cfg.fail_slow_max_rounds / cfg.fail_slow_rounds)
        return cfg.fail_slow_alpha / (looks * (2 if hinted else 1))

    def choose_group(self, roots: Sequence[int]) -> tuple[str, tuple[int, ...]]:
        """The parallel group around these root ranks (see module docstring)."""
        return choose_group(self.topology, roots, self._preference)

    def choose_eviction(self, roots: Sequence[int]) -> Eviction:
        """What to evict for these root ranks: their group, unless too large a share of the job."""
        return choose_eviction(self.topology, roots, self._preference, self.config.max_group_share)

    def _why(self, states: list[RankState], ra: RoundAnalysis) -> str:
        root = states[ra.roots[0]]
        if root.main is None:
            return f"{ra.cause}: no dump for rank {root.rank}"
        text = f"{ra.cause}: {root.role.value} in {root.main.top}"
        busy = [c for c in root.children if c.busy]
        if busy and root.role != Role.COMPUTE:
            c = busy[0]
            where = c.stack.frames[0] if c.stack.frames else "?"
            text += f"; its {c.process.value} process {c.pid} is busy in {where}"
        return text

    def _healthy(
        self,
        states: list[RankState],
        ra: RoundAnalysis,
        analysis: str,
        n_rounds: int,
        votes: tuple[Vote, ...] = (),
    ) -> OverEvictionResult:
        if ra.roots:
            cfg = self.config
            reason = (
                f"best candidate root(s) {_short(ra.roots)} reached by {ra.reach}/{ra.world} ranks "
                f"(a root needs >= {cfg.min_reach_fraction:.0%} of ranks waiting on it "
                f"and <= {cfg.max_root_fraction:.0%} of ranks in it)"
            )
        else:
            reason = "no rank waits on another: nothing stands out"
        nothing = Eviction(None, (), ())
        return self._result(Verdict.HEALTHY, (), nothing, states, ra, analysis, n_rounds, reason, votes)

    def _result(
        self,
        verdict: Verdict,
        suspects: tuple[int, ...],
        eviction: Eviction,
        states: list[RankState],
        ra: RoundAnalysis,
        analysis: str,
        n_rounds: int,
        reason: str,
        votes: tuple[Vote, ...] = (),
    ) -> OverEvictionResult:
        evidence = Evidence(
            reason=reason,
            analysis=analysis,
            rounds=n_rounds,
            cause=ra.cause if verdict != Verdict.HEALTHY else "none",
            root_reach=ra.reach_fraction,
            missing_ranks=tuple(st.rank for st in states if st.main is None),
            classes=_stack_classes(states, ra, set(suspects)),
            votes=votes,
        )
        ev = eviction
        return OverEvictionResult(
            verdict, suspects, ev.kind, ev.ranks, ev.machines, evidence, ev.why, ev.not_evicted
        )


def _chance(p_value: float, candidates: int, agreed: bool) -> str:
    among = "the straggler signal's rank(s)" if agreed else f"any of the {candidates} ranks"
    return f"chance p = {p_value:.3g} for {among}"


def _short(ranks: Sequence[int], limit: int = 16) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return f"[{shown}{', ...' if len(ranks) > limit else ''}]"


def _stack_classes(states: list[RankState], ra: RoundAnalysis, suspects: set[int]) -> tuple[StackClass, ...]:
    out = []
    for _sig, ranks in ra.classes:
        st = states[ranks[0]]
        frames = st.main.frames if st.main else ()
        out.append(StackClass("main", st.role.value, ranks, frames, any(r in suspects for r in ranks)))
    helpers: dict[tuple[str, bool, str], list[int]] = {}
    info: dict[tuple[str, bool, str], tuple[str, tuple[str, ...]]] = {}
    for st in states:
        for c in st.children:
            key = (c.process.value, c.busy, c.stack.signature)
            helpers.setdefault(key, []).append(st.rank)
            info[key] = (c.stack.role.value, c.stack.frames)
    for key, helper_ranks in sorted(helpers.items(), key=lambda kv: (-len(kv[1]), kv[1][0])):
        role, frames = info[key]
        suspect = key[1] and any(r in suspects for r in helper_ranks)
        out.append(StackClass(key[0], role, tuple(helper_ranks), frames, suspect, busy=key[1]))
    return tuple(out)
