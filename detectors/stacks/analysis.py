"""One round of stacks -> the rank(s) the rest of the job is waiting on.

ByteRobust (§5) groups stacks by string and treats the dominant group(s) as healthy.  A real
3D-parallel hang has several healthy groups (DP all-reduce, PP recv forward/backward, TP
all-reduce, blocked send), so this module uses the parallel structure instead of a majority:

1. Ranks are grouped into classes by stack signature (frames without line numbers).
2. Each *waiting* rank gets edges to the ranks it waits on: a P2P op to its pipeline neighbour
   (direction from the frames, or the only neighbour a first/last stage has); a collective to
   the members of its group that are *not* in the same collective class.  The group kind comes
   from the frames when they say; otherwise every incomplete kind is a candidate, except kinds
   whose absent members themselves wait on this rank.  A collective whose whole group is inside
   it is stuck in itself: its members wait on each other.
3. Ranks in compute, data loading, checkpointing or a local wait, and missing ranks, wait on no
   one.  The sink components of this wait-for graph are the candidate roots: one busy rank, a
   stuck collective's group, or a P2P deadlock cycle (e.g. a skipped send).
4. The root is the sink that the most ranks reach.  It counts only when a large enough share of
   the job reaches it, it is small enough to localise something (config thresholds), and --
   when it is busy rather than stuck -- it lies in one DP replica.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from detectors.stacks.config import OverEvictionConfig
from detectors.stacks.loader import Round
from detectors.stacks.patterns import WAITING_ROLES, Role
from detectors.stacks.roles import ChildInfo, StackInfo, StackReader
from schemas.topology import DIMS, JobTopology

MISSING_SIGNATURE = "<no dump>"


@dataclass(frozen=True, slots=True)
class RankState:
    """What one rank was doing in one round; ``main`` is ``None`` when it had no dump."""

    rank: int
    main: StackInfo | None
    children: tuple[ChildInfo, ...] = ()

    @property
    def role(self) -> Role:
        return Role.MISSING if self.main is None else self.main.role

    @property
    def signature(self) -> str:
        return MISSING_SIGNATURE if self.main is None else self.main.signature


def rank_states(round_: Round, world_size: int, reader: StackReader) -> list[RankState]:
    """One state per rank ``0..world_size-1``; ranks without a main dump are missing."""
    extra = sorted(r for r in round_ if r >= world_size)
    if extra:
        raise ValueError(f"dumps for rank(s) {extra[:5]} but the topology has only {world_size} ranks")
    out = []
    for r in range(world_size):
        rd = round_.get(r)
        if rd is None:
            out.append(RankState(r, None))
            continue
        main = None
        if rd.main is not None:
            thread = rd.main.main_thread()
            main = reader.read(thread.frames if thread else ())
        kids = []
        for child in rd.children:
            thread = child.main_thread()
            kids.append(reader.read_child(child.pid, thread.frames if thread else ()))
        out.append(RankState(r, main, tuple(kids)))
    return out


@dataclass(frozen=True)
class RoundAnalysis:
    """The wait-for analysis of one round."""

    roots: tuple[int, ...]  # ranks of the chosen sink (empty: nothing stands out)
    reach: int  # ranks (roots included) that wait on the roots, directly or transitively
    world: int
    cause: str  # "busy" | "missing" | "p2p-cycle" | "stuck-collective" | "none"
    classes: tuple[tuple[str, tuple[int, ...]], ...]  # (signature, ranks), biggest first
    confident: bool  # reach and root-size thresholds met

    @property
    def reach_fraction(self) -> float:
        return self.reach / self.world if self.world else 0.0


class _Layout:
    """Group ids and pipeline neighbours by stride arithmetic (fast for 10^4 ranks)."""

    def __init__(self, topo: JobTopology) -> None:
        self.size: dict[str, int] = {d: topo.size(d) for d in DIMS}
        self.stride: dict[str, int] = {}
        step = 1
        for d in topo.order.split("-"):
            self.stride[d] = step
            step *= self.size[d]

    def coord(self, kind: str, rank: int) -> int:
        return (rank // self.stride[kind]) % self.size[kind]

    def gid(self, kind: str, rank: int) -> int:
        """The group's first rank: ``rank`` with its ``kind`` coordinate set to 0."""
        return rank - self.coord(kind, rank) * self.stride[kind]

    def members(self, kind: str, gid: int) -> range:
        st = self.stride[kind]
        return range(gid, gid + self.size[kind] * st, st)

    def neighbour(self, rank: int, step: int) -> int:
        # Pipelines are rings in Megatron's P2P helpers (interleaved schedules wrap around).
        c, n, st = self.coord("pp", rank), self.size["pp"], self.stride["pp"]
        return rank + ((c + step) % n - c) * st


def _p2p_targets(lay: _Layout, rank: int, peer: str | None) -> list[int]:
    n = lay.size["pp"]
    c = lay.coord("pp", rank)
    if peer == "prev":
        return [lay.neighbour(rank, -1)]
    if peer == "next":
        return [lay.neighbour(rank, +1)]
    # Unknown direction: a first or last stage has a single neighbour, a middle stage two.
    steps = ([+1] if c < n - 1 else []) + ([-1] if c > 0 else [])
    return [lay.neighbour(rank, s) for s in steps]


def _tarjan_sinks(out: list[list[int]]) -> list[list[int]]:
    """Strongly connected components with no edge leaving them (iterative Tarjan)."""
    n = len(out)
    index = [-1] * n
    low = [0] * n
    comp = [-1] * n
    on_stack = [False] * n
    stack: list[int] = []
    comps: list[list[int]] = []
    counter = 0
    for start in range(n):
        if index[start] != -1:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            edges = out[v]
            if i < len(edges):
                work.append((v, i + 1))
                w = edges[i]
                if index[w] == -1:
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                members = []
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = len(comps)
                    members.append(w)
                    if w == v:
                        break
                comps.append(members)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return [c for c in comps if all(comp[w] == comp[c[0]] for v in c for w in out[v])]


def analyze_round(states: list[RankState], topo: JobTopology, cfg: OverEvictionConfig) -> RoundAnalysis:
    """Find the rank(s) this round's waiting ranks are blocked on."""
    n = topo.world_size
    lay = _Layout(topo)
    kinds: list[str] = [k for k in DIMS if lay.size[k] > 1]
    sig_id: dict[str, int] = {}
    cls = [sig_id.setdefault(st.signature, len(sig_id)) for st in states]

    # uniform[k][gid] = the class every member of that group is in, or -1 when mixed.
    uniform: dict[str, dict[int, int]] = {}
    for k in kinds:
        u: dict[int, int] = {}
        for r in range(n):
            g = lay.gid(k, r)
            prev = u.get(g)
            if prev is None:
                u[g] = cls[r]
            elif prev != cls[r]:
                u[g] = -1
        uniform[k] = u
    missing_cache: dict[tuple[str, int, int], list[int]] = {}

    def others(k: str, g: int, c: int) -> list[int]:
        key = (k, g, c)
        got = missing_cache.get(key)
        if got is None:
            got = missing_cache[key] = [m for m in lay.members(k, g) if cls[m] != c]
        return got

    out: list[list[int]] = [[] for _ in range(n)]
    # Collectives whose frames do not say their group: per rank, kind -> members not in it yet.
    unhinted: dict[int, dict[str, list[int]]] = {}
    complete: dict[int, list[str]] = {}
    for st in states:
        info = st.main
        if info is None or info.role not in WAITING_ROLES:
            continue
        r = st.rank
        if info.role == Role.P2P and lay.size["pp"] > 1:
            out[r] = [t for t in _p2p_targets(lay, r, info.peer) if t != r]
            continue
        hinted = info.kind is not None and info.kind in kinds
        per_kind: dict[str, list[int]] = {}
        for k in [info.kind] if info.kind is not None and hinted else kinds:
            g = lay.gid(k, r)
            if uniform[k][g] == cls[r]:
                complete.setdefault(r, []).append(k)
            else:
                per_kind[k] = others(k, g, cls[r])
        if not hinted:
            unhinted[r] = per_kind
        out[r] = [m for ms in per_kind.values() for m in ms]
    size = Counter(cls)
    prelim = {r: set(out[r]) for r in unhinted}
    for r, per_kind in unhinted.items():
        # A kind whose absent members wait on this very rank cannot be the collective's group:
        # in a well-formed program they would be inside it, not blocked on it.  An absent
        # member counts when its own wait is certain (P2P, or a collective whose frames name
        # its group), or when it is an unhinted collective of a bigger class (the crowd is in
        # the group's collective; the odd one out is in another).  Fig. 7: the last stage's
        # all-gather is not DP (its DP peers wait on it) nor PP (the previous stage's send waits
        # on it), so it is TP, stuck in itself.
        def waits_on_r(m: int, r: int = r) -> bool:
            if m in prelim:
                return r in prelim[m] and size[cls[m]] > size[cls[r]]
            return r in out[m]

        kept = [ms for ms in per_kind.values() if not any(waits_on_r(m) for m in ms)]
        if kept or not complete.get(r):
            out[r] = [m for ms in (kept or per_kind.values()) for m in ms]
        else:
            out[r] = []
    for r, kinds_done in complete.items():
        if not out[r]:
            # Every member of its group is in this same collective: it is stuck in itself.
            out[r] = [m for k in kinds_done for m in lay.members(k, lay.gid(k, r)) if m != r]

    sinks = _merge_busy_tp(_tarjan_sinks(out), states, lay)
    if not cfg.missing_ranks_are_suspects:
        sinks = [sk for sk in sinks if any(states[v].main is not None for v in sk)]
    rev: list[list[int]] = [[] for _ in range(n)]
    for v, ts in enumerate(out):
        for t in ts:
            rev[t].append(v)
    best: list[list[int]] = []
    best_seen: set[int] = set()
    best_reach = 0
    for sink in sinks:
        seen: set[int] = set(sink)
        todo: list[int] = list(sink)
        while todo:
            v = todo.pop()
            for w in rev[v]:
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        if len(seen) > best_reach:
            best, best_seen, best_reach = [sink], seen, len(seen)
        elif len(seen) == best_reach:
            # Equally waited-on sinks (e.g. every rank of a dead machine) are roots together.
            best.append(sink)
            best_seen = best_seen | seen
    roots = tuple(sorted(v for s in best for v in s))
    best_reach = len(best_seen)
    classes = _classes(cls, states)
    if not roots or best_reach <= len(roots):
        # Nobody waits on anybody: every rank is busy on its own (or alone).
        return RoundAnalysis((), 0, n, "none", classes, False)
    confident = best_reach >= cfg.min_reach_fraction * n and len(roots) <= cfg.max_root_fraction * n
    if confident and lay.size["dp"] > 1 and any(states[r].role not in WAITING_ROLES for r in roots):
        # Busy roots in different DP replicas are ordinary overlap (a pipeline stage computing in
        # every replica at once), not one fault: a faulty rank holds up its own replica while
        # the other replicas finish and wait for it in the DP collective.
        confident = len({lay.coord("dp", r) for r in roots}) == 1
    return RoundAnalysis(roots, best_reach, n, _cause(roots, states), classes, confident)


def _merge_busy_tp(sinks: list[list[int]], states: list[RankState], lay: _Layout) -> list[list[int]]:
    """Busy (or missing) single ranks of one TP group form one sink.

    Tensor-parallel ranks run the same layer in lockstep: while one of them is slow its peers
    are busy in the same layer too, and which of them the job seems to wait on is a matter of
    sampling instants.  Counting them as one unit keeps the reach of a slow TP group whole.
    """
    if lay.size["tp"] == 1:
        return sinks
    merged: dict[int, list[int]] = {}
    out = []
    for sink in sinks:
        if len(sink) == 1 and states[sink[0]].role not in WAITING_ROLES:
            merged.setdefault(lay.gid("tp", sink[0]), []).extend(sink)
        else:
            out.append(sink)
    return out + list(merged.values())


def _cause(roots: tuple[int, ...], states: list[RankState]) -> str:
    roles = {states[r].role for r in roots}
    if roles == {Role.MISSING}:
        return "missing"
    if roles - WAITING_ROLES - {Role.MISSING}:
        return "busy"  # compute, data loading, checkpointing or a local wait
    if roles == {Role.P2P}:
        return "p2p-cycle"  # e.g. a skipped send: two stages each waiting on the other
    return "stuck-collective"


def _classes(cls: list[int], states: list[RankState]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    by: dict[int, list[int]] = {}
    for r, c in enumerate(cls):
        by.setdefault(c, []).append(r)
    items = [(states[rs[0]].signature, tuple(rs)) for rs in by.values()]
    items.sort(key=lambda it: (-len(it[1]), it[1][0]))
    return tuple(items)
