"""Which standby takes which leaving machine's slot: Arnold's objective, kept through recoveries.

:func:`choose_replacements` assigns one candidate standby to each leaving slot, minimising, in
this order (a lexicographic key; each element only breaks the ties of the ones before it):

1. the number of candidates outside ``prefer`` used (the action service prefers the standbys
   that are ready now: taking one still starting makes the whole job wait for it);
2. Arnold's objective ``alpha * max DP-group spread + beta * max PP-group spread`` of the job
   after the swap (spread: distinct pods a group spans; :mod:`trainguard.detectors.placement.layout`);
3. the same weighted sum over the groups the swap touches (the maxima rarely move: this keeps
   the other groups compact so the next failure does not move them either);
4. the weighted sum of the touched groups' rack spreads (a rack shares a leaf switch);
5. the chosen names, slot by slot in the order ``leaving`` lists them (lexicographically).

Candidates at the same (pod, rack) are interchangeable for 1-4, so the search runs over these
position classes, each handing out its members in name order (which gives 5).

**Exact** -- a depth-first branch and bound over the leaving slots (classes tried in the order
of the name they would hand out).  The leaving machines are taken out of their groups first, so
filling a slot only ever adds pods and racks: the key of a partial assignment, plus what its open
slots must still add, bounds every completion from below.  "Must still add" per group: nothing
while the free candidates in pods (racks) the group already spans can fill its open slots, else
the fewest new pods (racks) whose free candidates can; and candidates outside ``prefer`` for the
open slots the preferred ones cannot fill.  A branch whose bound exceeds the best answer so far
(or equals it with later names) is cut.  The search starts from the heuristic's answer and
first-free's, so it only has to prove or improve them.

**Heuristic** -- what stands when the search has visited ``exact_nodes`` nodes without finishing
(the per-group bound ignores that one slot's standby cannot serve two groups' wishes, so a
pipeline over-evicted into a pool that lacks some of its pods can take many nodes to prove):
slot by slot in ``leaving`` order, the class that keeps the key smallest; then single moves (a
slot to another class, two slots exchanging theirs) while one lowers the cost.  On 200 random
small cases (``tests/detectors/test_placement.py``) it matched the exact objective 197 times.

Every answer is at least as good as first-free's (candidates in the given order, ``prefer``
ones first), a seed of the search.  Same inputs, same answer: no clock, no randomness, and the
answer does not depend on the candidates' order unless first-free's is strictly the best found.

>>> from trainguard.detectors.placement.layout import Groups
>>> from trainguard.schemas.network import MachinePosition as P
>>> g = Groups.explicit(4, dp=[[0, 1], [2, 3]], pp=[[0, 2], [1, 3]])
>>> pos = {"a": P("p1"), "b": P("p1"), "c": P("p2"), "d": P("p2"), "s1": P("p2"), "s2": P("p1")}
>>> r = choose_replacements(["a", "b", "c", "d"], g, ["b"], ["s1", "s2"], pos)
>>> r.chosen, r.method, r.before.describe(r.after)
(('s2',), 'exact', 'dp_spread 1->1 pp_spread 2->2')
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat

from trainguard.detectors.placement.config import PlacementConfig
from trainguard.detectors.placement.layout import Groups, Spread, pod_key, rack_key, spreads
from trainguard.schemas.network import MachinePosition

#: (candidates outside ``prefer``, objective, touched groups' pod spreads, their rack spreads)
Cost = tuple[int, float, float, float]
_ZEROS = repeat(0)  # the default of every ``capacity.get`` in :func:`_more` (map stops first)


@dataclass(frozen=True)
class Replacement:
    """The planner's answer: ``chosen[i]`` takes the slot of ``leaving[i]``."""

    leaving: tuple[str, ...]
    chosen: tuple[str, ...]
    before: Spread
    after: Spread
    #: "exact" (proven optimal), "heuristic" (search budget spent) or "first_free" (no position known).
    method: str
    #: search nodes visited (each a slot tentatively filled).
    nodes: int
    #: the minimised key without the names: (candidates outside ``prefer``, objective,
    #: touched groups' weighted pod spreads, their weighted rack spreads).
    key: Cost


@dataclass
class _Class:
    """Candidates sharing a (pod, rack): interchangeable; handed out in name order."""

    pod: str
    rack: str
    preferred: bool
    names: list[str]
    used: int = 0

    @property
    def free(self) -> bool:
        return self.used < len(self.names)

    def next(self) -> str:
        return self.names[self.used]


class _State:
    """One (partial) assignment: per touched group, its machines per pod and per rack.

    The leaving machines are out of every group from the start, so filling a slot only adds."""

    def __init__(
        self, pods: list[str], racks: list[str], groups: Groups, slots: list[int], cfg: PlacementConfig
    ):
        self.cfg = cfg
        dp_of, pp_of = groups.member_of()
        touched: dict[tuple[str, int], int] = {}
        for s in slots:
            for kind, ids in (("dp", dp_of[s]), ("pp", pp_of[s])):
                for g in ids:
                    touched.setdefault((kind, g), len(touched))
        self.is_dp = [kind == "dp" for kind, _ in touched]
        self.weight = [cfg.alpha if dp else cfg.beta for dp in self.is_dp]
        #: per leaving slot (in ``leaving`` order): the state indices of its groups.
        self.slot_groups = [
            [touched[("dp", g)] for g in dp_of[s]] + [touched[("pp", g)] for g in pp_of[s]] for s in slots
        ]
        #: per touched group: the leaving slots (indices in ``leaving``) it holds, ascending.
        self.holds: list[list[int]] = [[] for _ in touched]
        for i, gs in enumerate(self.slot_groups):
            for g in gs:
                self.holds[g].append(i)
        gone = set(slots)
        self.pods: list[dict[str, int]] = []
        self.racks: list[dict[str, int]] = []
        for kind, g in touched:
            p: dict[str, int] = {}
            r: dict[str, int] = {}
            for s in (groups.dp if kind == "dp" else groups.pp)[g]:
                if s not in gone:
                    p[pods[s]] = p.get(pods[s], 0) + 1
                    r[racks[s]] = r.get(racks[s], 0) + 1
            self.pods.append(p)
            self.racks.append(r)

        widths = {
            (kind, what): spreads(groups.dp if kind == "dp" else groups.pp, keys)
            for kind in ("dp", "pp")
            for what, keys in (("pods", pods), ("racks", racks))
        }

        def widest(kind: str, what: str, skip: Collection[tuple[str, int]] = ()) -> int:
            return max((n for i, n in enumerate(widths[kind, what]) if (kind, i) not in skip), default=0)

        #: the job's spread before the swap (the leaving machines still in place).
        self.before = Spread(
            widest("dp", "pods"), widest("pp", "pods"), widest("dp", "racks"), widest("pp", "racks")
        )
        # The untouched groups' widest spreads: the same whatever is chosen.
        self.base = Spread(
            widest("dp", "pods", touched),
            widest("pp", "pods", touched),
            widest("dp", "racks", touched),
            widest("pp", "racks", touched),
        )
        self.outside = 0  # candidates used that are not preferred
        self.nodes = 0
        #: free candidates per pod and per rack, and preferred ones (:meth:`offer`).
        self.pod_cap: dict[str, int] = {}
        self.rack_cap: dict[str, int] = {}
        self.supply = 0

    def offer(self, classes: Sequence[_Class]) -> None:
        """The candidates the slots are filled from (their free capacity, for the bound)."""
        for c in classes:
            left = len(c.names) - c.used
            self.pod_cap[c.pod] = self.pod_cap.get(c.pod, 0) + left
            self.rack_cap[c.rack] = self.rack_cap.get(c.rack, 0) + left
            self.supply += left if c.preferred else 0

    def add(self, slot: int, c: _Class) -> None:
        self.nodes += 1
        c.used += 1
        self.outside += not c.preferred
        self.pod_cap[c.pod] -= 1
        self.rack_cap[c.rack] -= 1
        self.supply -= c.preferred
        for g in self.slot_groups[slot]:
            self.pods[g][c.pod] = self.pods[g].get(c.pod, 0) + 1
            self.racks[g][c.rack] = self.racks[g].get(c.rack, 0) + 1

    def remove(self, slot: int, c: _Class) -> None:
        c.used -= 1
        self.outside -= not c.preferred
        self.pod_cap[c.pod] += 1
        self.rack_cap[c.rack] += 1
        self.supply += c.preferred
        for g in self.slot_groups[slot]:
            for table, key in ((self.pods[g], c.pod), (self.racks[g], c.rack)):
                table[key] -= 1
                if not table[key]:
                    del table[key]

    def cost(self, filled: int | None = None) -> Cost:
        """The key of the assignment; with ``filled`` (slots filled so far), a lower bound on the
        key of every completion: what its open slots must still add to each group (:func:`_more`),
        and the candidates outside ``prefer`` they must use (beyond the preferred supply)."""
        outside = self.outside
        if filled is not None:
            outside += max(0, len(self.slot_groups) - filled - self.supply)
            pod_big, rack_big = _Largest(self.pod_cap), _Largest(self.rack_cap)
        max_dp, max_pp, pod_sum, rack_sum = self.base.dp, self.base.pp, 0.0, 0.0
        for g, pods in enumerate(self.pods):
            n, m = len(pods), len(self.racks[g])
            if filled is not None:
                still = len(self.holds[g]) - bisect_left(self.holds[g], filled)
                if still:
                    n += _more(still, pods, self.pod_cap, pod_big)
                    m += _more(still, self.racks[g], self.rack_cap, rack_big)
            if self.is_dp[g]:
                max_dp = max(max_dp, n)
            else:
                max_pp = max(max_pp, n)
            pod_sum += self.weight[g] * n
            rack_sum += self.weight[g] * m
        return (outside, self.cfg.alpha * max_dp + self.cfg.beta * max_pp, pod_sum, rack_sum)

    def spread(self) -> Spread:
        """The job's spread with every slot filled."""
        dp = [len(p) for p, d in zip(self.pods, self.is_dp, strict=True) if d]
        pp = [len(p) for p, d in zip(self.pods, self.is_dp, strict=True) if not d]
        dr = [len(r) for r, d in zip(self.racks, self.is_dp, strict=True) if d]
        pr = [len(r) for r, d in zip(self.racks, self.is_dp, strict=True) if not d]
        b = self.base
        return Spread(max([b.dp, *dp]), max([b.pp, *pp]), max([b.dp_racks, *dr]), max([b.pp_racks, *pr]))


class _Largest:
    """Free capacity per pod (rack), largest first, sorted only if a bound asks for it."""

    def __init__(self, capacity: Mapping[str, int]) -> None:
        self.capacity = capacity
        self._sorted: list[tuple[int, str]] | None = None

    def __iter__(self) -> Iterator[tuple[int, str]]:
        if self._sorted is None:
            self._sorted = sorted(((n, k) for k, n in self.capacity.items() if n), reverse=True)
        return iter(self._sorted)


def _more(slots: int, present: Mapping[str, int], capacity: Mapping[str, int], largest: _Largest) -> int:
    """The fewest pods (racks) a group must gain to fill its ``slots`` open slots: none while
    the free candidates in pods it ``present``-ly spans can fill them, else as few new pods as
    can hold the rest, the largest first (other groups' needs ignored: a lower bound)."""
    rest = slots - sum(map(capacity.get, present, _ZEROS))
    if rest <= 0:
        return 0
    gained = 0
    for n, key in largest:
        if key in present:
            continue
        gained += 1
        rest -= n
        if rest <= 0:
            break
    return gained


class _Planner:
    """The search over one :class:`_State`: seeds, the heuristic, the branch and bound."""

    def __init__(self, state: _State, classes: list[_Class]) -> None:
        self.s, self.classes = state, classes
        self.k = len(state.slot_groups)
        self.best: tuple[Cost, tuple[str, ...]] | None = None
        self.best_spread: Spread | None = None
        self.budget = 0
        self.exhausted = False

    def fill(self, picked: Sequence[_Class]) -> tuple[str, ...]:
        """Fill every slot with ``picked`` (a class per slot); the names handed out."""
        names = []
        for slot, c in enumerate(picked):
            names.append(c.next())
            self.s.add(slot, c)
        return tuple(names)

    def empty(self, picked: Sequence[_Class]) -> None:
        for slot in reversed(range(len(picked))):
            self.s.remove(slot, picked[slot])

    def evaluate(self, picked: Sequence[_Class], keep: bool = False) -> tuple[Cost, tuple[str, ...]]:
        """The key of ``picked``; ``keep``: also offer it as the best so far."""
        names = self.fill(picked)
        key = (self.s.cost(), names)
        if keep and (self.best is None or key < self.best):
            self.best, self.best_spread = key, self.s.spread()
        self.empty(picked)
        return key

    def greedy(self) -> list[_Class]:
        """Slot by slot, the class keeping the key smallest; then :meth:`improve`."""
        picked: list[_Class] = []
        for slot in range(self.k):
            best: tuple[Cost, str] | None = None
            choice = self.classes[0]
            for c in self.classes:
                if not c.free:
                    continue
                name = c.next()
                self.s.add(slot, c)
                key = (self.s.cost(), name)
                self.s.remove(slot, c)
                if best is None or key < best:
                    best, choice = key, c
            picked.append(choice)
            self.s.add(slot, choice)
        self.empty(picked)
        return self.improve(picked)

    def improve(self, picked: list[_Class]) -> list[_Class]:
        """Single moves (one slot to another class, two slots exchanging theirs) while one lowers
        the cost (names play no part here: the answer's names are handed out afterwards)."""
        picked = list(picked)
        s = self.s
        self.fill(picked)
        current = s.cost()
        for _round in range(4 * self.k + 4):  # bounded; each round lowers the cost or ends
            better: tuple[int, int, _Class | None] | None = None
            for i in range(self.k):
                old = picked[i]
                s.remove(i, old)
                for c in self.classes:
                    if c is old or not c.free:
                        continue
                    s.add(i, c)
                    cost = s.cost()
                    s.remove(i, c)
                    if cost < current:
                        better, current = (i, -1, c), cost
                s.add(i, old)
                for j in range(i + 1, self.k):
                    other = picked[j]
                    if other is old:
                        continue
                    s.remove(i, old)
                    s.remove(j, other)
                    s.add(i, other)
                    s.add(j, old)
                    cost = s.cost()
                    s.remove(j, old)
                    s.remove(i, other)
                    s.add(i, old)
                    s.add(j, other)
                    if cost < current:
                        better, current = (i, j, None), cost
            if better is None:
                break
            i, j, move = better
            s.remove(i, picked[i])
            if move is None:  # exchange
                s.remove(j, picked[j])
                picked[i], picked[j] = picked[j], picked[i]
                s.add(j, picked[j])
            else:
                picked[i] = move
            s.add(i, picked[i])
        self.empty(picked)
        return picked

    def search(self, slot: int, names: list[str]) -> None:
        """Depth-first branch and bound from ``slot`` (every earlier slot filled)."""
        if slot == self.k:
            key = (self.s.cost(), tuple(names))
            if self.best is None or key < self.best:
                self.best, self.best_spread = key, self.s.spread()
            return
        for c in sorted((c for c in self.classes if c.free), key=_Class.next):
            if self.s.nodes >= self.budget:
                self.exhausted = True
                return
            names.append(c.next())
            self.s.add(slot, c)
            assert self.best is not None  # seeded before the search
            bound = self.s.cost(slot + 1)
            if bound < self.best[0] or (bound == self.best[0] and tuple(names) <= self.best[1][: len(names)]):
                self.search(slot + 1, names)
            self.s.remove(slot, c)
            names.pop()
            if self.exhausted:
                return


def first_free(candidates: Sequence[str], k: int, prefer: Collection[str] | None = None) -> list[str]:
    """What TrainGuard did before the planner: the first ``k`` candidates, ``prefer`` ones first.

    >>> first_free(["s0", "s1", "s2"], 2, prefer={"s1", "s2"})
    ['s1', 's2']
    """
    if prefer is None:
        return list(candidates[:k])
    ordered = [c for c in candidates if c in prefer] + [c for c in candidates if c not in prefer]
    return ordered[:k]


def _classes(
    candidates: Sequence[str], positions: Mapping[str, MachinePosition], prefer: Collection[str]
) -> list[_Class]:
    by: dict[tuple[str, str, bool], _Class] = {}
    for name in sorted(set(candidates)):
        pod, rack, pref = pod_key(name, positions), rack_key(name, positions), name in prefer
        by.setdefault((pod, rack, pref), _Class(pod, rack, pref, [])).names.append(name)
    return list(by.values())


def choose_replacements(
    machines: Sequence[str],
    groups: Groups,
    leaving: Sequence[str],
    candidates: Sequence[str],
    positions: Mapping[str, MachinePosition],
    cfg: PlacementConfig | None = None,
    prefer: Collection[str] | None = None,
) -> Replacement:
    """Assign a candidate to each of ``leaving`` (see the module docstring for the key).

    ``machines`` holds the job's machine per slot, ``candidates`` the free standbys in the pool's
    order, ``prefer`` the ones to use first (None: all alike).  With no candidate's pod known,
    or the planner disabled, the answer is first-free's (``method`` "first_free").
    """
    cfg = cfg or PlacementConfig()
    if len(machines) != groups.n_slots:
        raise ValueError(f"{len(machines)} machines for {groups.n_slots} slots")
    if len(set(leaving)) != len(leaving):
        raise ValueError(f"leaving machines repeat: {list(leaving)}")
    index = {m: i for i, m in enumerate(machines)}
    strangers = [m for m in leaving if m not in index]
    if strangers:
        raise ValueError(f"leaving machines {strangers} are not machines of the job")
    unique = list(dict.fromkeys(candidates))
    if len(unique) < len(leaving):
        raise ValueError(f"{len(unique)} candidates for {len(leaving)} leaving machines")
    pods = [pod_key(m, positions) for m in machines]
    racks = [rack_key(m, positions) for m in machines]
    state = _State(pods, racks, groups, [index[m] for m in leaving], cfg)
    pref = set(unique) if prefer is None else set(prefer)
    classes = _classes(unique, positions, pref)
    state.offer(classes)
    planner = _Planner(state, classes)
    by_name = {n: c for c in classes for n in c.names}
    plain = [by_name[n] for n in first_free(unique, len(leaving), prefer)]
    if not cfg.enabled or not leaving or not any(positions.get(c, MachinePosition()).known for c in unique):
        planner.evaluate(plain, keep=True)
        chosen, method = tuple(first_free(unique, len(leaving), prefer)), "first_free"
    else:
        # Seeds: first-free's classes (so the answer is never worse) and the heuristic's.
        planner.evaluate(plain, keep=True)
        planner.evaluate(planner.greedy(), keep=True)
        planner.budget = state.nodes + cfg.exact_nodes
        planner.search(0, [])
        assert planner.best is not None
        chosen, method = planner.best[1], "heuristic" if planner.exhausted else "exact"
    assert planner.best is not None and planner.best_spread is not None
    return Replacement(
        tuple(leaving), chosen, state.before, planner.best_spread, method, state.nodes, planner.best[0]
    )
