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
from dataclasses import dataclass, field

from trainguard.detectors.stacks.config import OverEvictionConfig
from trainguard.detectors.stacks.loader import Round
from trainguard.detectors.stacks.patterns import WAITING_ROLES, Role
from trainguard.detectors.stacks.roles import ChildInfo, StackInfo, StackReader
from trainguard.schemas.topology import DIMS, JobTopology

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
    extra = sorted(rank for rank in round_ if rank >= world_size)
    if extra:
        raise ValueError(f"dumps for rank(s) {extra[:5]} but the topology has only {world_size} ranks")
    states = []
    for rank in range(world_size):
        dumps = round_.get(rank)
        if dumps is None:
            states.append(RankState(rank, None))
            continue
        main = None
        if dumps.main is not None:
            thread = dumps.main.main_thread()
            main = reader.read(thread.frames if thread else ())
        children = []
        for child in dumps.children:
            thread = child.main_thread()
            children.append(reader.read_child(child.pid, thread.frames if thread else ()))
        states.append(RankState(rank, main, tuple(children)))
    return states


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
        self.world_size = topo.world_size
        self.size: dict[str, int] = {dim: topo.size(dim) for dim in DIMS}
        self.stride: dict[str, int] = {}
        step = 1
        for dim in topo.order.split("-"):
            self.stride[dim] = step
            step *= self.size[dim]

    def coord(self, kind: str, rank: int) -> int:
        return (rank // self.stride[kind]) % self.size[kind]

    def group_id(self, kind: str, rank: int) -> int:
        """The group's first rank: ``rank`` with its ``kind`` coordinate set to 0."""
        return rank - self.coord(kind, rank) * self.stride[kind]

    def members(self, kind: str, group_id: int) -> range:
        stride = self.stride[kind]
        return range(group_id, group_id + self.size[kind] * stride, stride)

    def neighbour(self, rank: int, step: int) -> int:
        # Pipelines are rings in Megatron's P2P helpers (interleaved schedules wrap around).
        stage, stages, stride = self.coord("pp", rank), self.size["pp"], self.stride["pp"]
        return rank + ((stage + step) % stages - stage) * stride


def _p2p_targets(layout: _Layout, rank: int, peer: str | None) -> list[int]:
    if peer == "prev":
        return [layout.neighbour(rank, -1)]
    if peer == "next":
        return [layout.neighbour(rank, +1)]
    # Unknown direction: a first or last stage has a single neighbour, a middle stage two.
    stage, stages = layout.coord("pp", rank), layout.size["pp"]
    steps = ([+1] if stage < stages - 1 else []) + ([-1] if stage > 0 else [])
    return [layout.neighbour(rank, step) for step in steps]


def _tarjan_sinks(waits_on: list[list[int]]) -> list[list[int]]:
    """Strongly connected components with no edge leaving them (iterative Tarjan)."""
    count = len(waits_on)
    index = [-1] * count
    low = [0] * count
    component_of = [-1] * count
    on_stack = [False] * count
    stack: list[int] = []
    components: list[list[int]] = []
    counter = 0
    for start in range(count):
        if index[start] != -1:
            continue
        work = [(start, 0)]  # (node, index of its next edge to follow)
        while work:
            node, edge = work.pop()
            if edge == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack[node] = True
            edges = waits_on[node]
            if edge < len(edges):
                work.append((node, edge + 1))
                target = edges[edge]
                if index[target] == -1:
                    work.append((target, 0))
                elif on_stack[target]:
                    low[node] = min(low[node], index[target])
                continue
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack[member] = False
                    component_of[member] = len(components)
                    members.append(member)
                    if member == node:
                        break
                components.append(members)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return [
        component
        for component in components
        if all(
            component_of[target] == component_of[component[0]]
            for node in component
            for target in waits_on[node]
        )
    ]


@dataclass(slots=True)
class _WaitGraph:
    """The wait-for graph of one round while it is being built."""

    #: ``waits_on[rank]``: the ranks ``rank`` waits on (empty for ranks that wait on no one).
    waits_on: list[list[int]]
    #: Collectives whose frames do not say their group: rank -> {candidate kind: the members of
    #: that group outside the rank's class}.
    unhinted: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    #: rank -> the kinds whose whole group is in the rank's own collective class.
    complete: dict[int, list[str]] = field(default_factory=dict)


def analyze_round(states: list[RankState], topo: JobTopology, cfg: OverEvictionConfig) -> RoundAnalysis:
    """Find the rank(s) this round's waiting ranks are blocked on.

    The steps, in order:

    1. :func:`_signature_classes`: number the stack classes; ``class_of[rank]`` is the rank's.
    2. :func:`_group_classes`: per kind and group, the class all its members share, if any.
    3. :func:`_direct_waits`: the edges the frames give -- a P2P op to its pipeline neighbour(s),
       a collective to the members of its group (or of every candidate group) outside its class.
    4. :func:`_drop_kinds_waiting_on_the_rank`: an unhinted collective keeps only the candidate
       kinds whose absent members do not themselves wait on it.
    5. :func:`_wait_inside_stuck_collectives`: a collective with no edge left whose whole group
       is in it waits on the rest of that group.
    6. :func:`_candidate_roots`: the sink components of the graph (busy TP peers merged, sinks
       of missing ranks only dropped unless missing ranks are suspects).
    7. :func:`_most_waited_on`: the sink(s) the most ranks reach, and how many ranks reach them.
    8. :func:`_is_confident`: whether that root is trusted (reach and size thresholds, and busy
       roots in one DP replica); no one waiting on anyone gives the verdict ``none``.
    """
    layout = _Layout(topo)
    kinds: list[str] = [kind for kind in DIMS if layout.size[kind] > 1]
    class_of = _signature_classes(states)
    group_class = _group_classes(layout, kinds, class_of)
    graph = _direct_waits(states, layout, kinds, class_of, group_class)
    _drop_kinds_waiting_on_the_rank(graph, class_of)
    _wait_inside_stuck_collectives(graph, layout)
    sinks = _candidate_roots(graph.waits_on, states, layout, cfg)
    roots, reach = _most_waited_on(sinks, graph.waits_on)
    classes = _classes(class_of, states)
    world_size = layout.world_size
    if not roots or reach <= len(roots):
        # Nobody waits on anybody: every rank is busy on its own (or alone).
        return RoundAnalysis((), 0, world_size, "none", classes, False)
    confident = _is_confident(roots, reach, states, layout, cfg)
    return RoundAnalysis(roots, reach, world_size, _cause(roots, states), classes, confident)


def _signature_classes(states: list[RankState]) -> list[int]:
    """Each rank's class id: ranks with the same stack signature share one, numbered in rank order."""
    class_ids: dict[str, int] = {}
    return [class_ids.setdefault(state.signature, len(class_ids)) for state in states]


def _group_classes(layout: _Layout, kinds: list[str], class_of: list[int]) -> dict[str, dict[int, int]]:
    """``group_class[kind][group_id]``: the class every member of that group is in, or -1 when mixed."""
    group_class: dict[str, dict[int, int]] = {}
    for kind in kinds:
        by_group: dict[int, int] = {}
        for rank in range(layout.world_size):
            group = layout.group_id(kind, rank)
            seen = by_group.get(group)
            if seen is None:
                by_group[group] = class_of[rank]
            elif seen != class_of[rank]:
                by_group[group] = -1
        group_class[kind] = by_group
    return group_class


def _direct_waits(
    states: list[RankState],
    layout: _Layout,
    kinds: list[str],
    class_of: list[int],
    group_class: dict[str, dict[int, int]],
) -> _WaitGraph:
    """The wait-for edges the frames give, before unhinted collectives are narrowed down.

    A P2P op waits on its pipeline neighbour(s).  A collective waits on the members of its
    group that are not in its class; when its frames do not name the group, on those of every
    kind whose group is incomplete (recorded in ``unhinted`` for step 4).  A kind whose whole
    group is in the rank's class is recorded in ``complete`` (step 5).
    """
    graph = _WaitGraph([[] for _ in range(layout.world_size)])
    outside_cache: dict[tuple[str, int, int], list[int]] = {}

    def members_outside(kind: str, group: int, class_id: int) -> list[int]:
        key = (kind, group, class_id)
        members = outside_cache.get(key)
        if members is None:
            members = outside_cache[key] = [
                member for member in layout.members(kind, group) if class_of[member] != class_id
            ]
        return members

    pipelined = layout.size["pp"] > 1
    for state in states:
        info = state.main
        if info is None or info.role not in WAITING_ROLES:
            continue
        rank = state.rank
        if info.role == Role.P2P and pipelined:
            graph.waits_on[rank] = [
                target for target in _p2p_targets(layout, rank, info.peer) if target != rank
            ]
            continue
        hinted_kind = info.kind if info.kind in kinds else None
        absent_by_kind: dict[str, list[int]] = {}
        for kind in [hinted_kind] if hinted_kind is not None else kinds:
            group = layout.group_id(kind, rank)
            if group_class[kind][group] == class_of[rank]:
                graph.complete.setdefault(rank, []).append(kind)
            else:
                absent_by_kind[kind] = members_outside(kind, group, class_of[rank])
        if hinted_kind is None:
            graph.unhinted[rank] = absent_by_kind
        graph.waits_on[rank] = [member for members in absent_by_kind.values() for member in members]
    return graph


def _drop_kinds_waiting_on_the_rank(graph: _WaitGraph, class_of: list[int]) -> None:
    """Narrow each unhinted collective's edges to the kinds that can be its group.

    A kind whose absent members wait on this very rank cannot be the collective's group: in a
    well-formed program they would be inside it, not blocked on it.  An absent member counts
    when its own wait is certain (P2P, or a collective whose frames name its group), or when it
    is an unhinted collective of a bigger class (the crowd is in the group's collective; the odd
    one out is in another).  Fig. 7: the last stage's all-gather is not DP (its DP peers wait on
    it) nor PP (the previous stage's send waits on it), so it is TP, stuck in itself.  When no
    kind is left, the rank keeps every candidate, unless some group is complete (step 5).
    """
    waits_on = graph.waits_on
    class_size = Counter(class_of)
    first_guess = {rank: set(waits_on[rank]) for rank in graph.unhinted}

    def member_waits_on(member: int, rank: int) -> bool:
        if member in first_guess:
            return rank in first_guess[member] and class_size[class_of[member]] > class_size[class_of[rank]]
        return rank in waits_on[member]

    for rank, absent_by_kind in graph.unhinted.items():
        kept = [
            members
            for members in absent_by_kind.values()
            if not any(member_waits_on(member, rank) for member in members)
        ]
        if kept or not graph.complete.get(rank):
            waits_on[rank] = [member for members in (kept or absent_by_kind.values()) for member in members]
        else:
            waits_on[rank] = []


def _wait_inside_stuck_collectives(graph: _WaitGraph, layout: _Layout) -> None:
    """A collective left waiting on no one, with every member of its group inside it, is stuck
    in itself: its members wait on each other."""
    for rank, complete_kinds in graph.complete.items():
        if not graph.waits_on[rank]:
            graph.waits_on[rank] = [
                member
                for kind in complete_kinds
                for member in layout.members(kind, layout.group_id(kind, rank))
                if member != rank
            ]


def _candidate_roots(
    waits_on: list[list[int]], states: list[RankState], layout: _Layout, cfg: OverEvictionConfig
) -> list[list[int]]:
    """The sink components of the wait-for graph: the groups of ranks that wait on no one else."""
    sinks = _merge_busy_tp(_tarjan_sinks(waits_on), states, layout)
    if not cfg.missing_ranks_are_suspects:
        sinks = [sink for sink in sinks if any(states[rank].main is not None for rank in sink)]
    return sinks


def _merge_busy_tp(sinks: list[list[int]], states: list[RankState], layout: _Layout) -> list[list[int]]:
    """Busy (or missing) single ranks of one TP group form one sink.

    Tensor-parallel ranks run the same layer in lockstep: while one of them is slow its peers
    are busy in the same layer too, and which of them the job seems to wait on is a matter of
    sampling instants.  Counting them as one unit keeps the reach of a slow TP group whole.
    """
    if layout.size["tp"] == 1:
        return sinks
    merged: dict[int, list[int]] = {}
    kept = []
    for sink in sinks:
        if len(sink) == 1 and states[sink[0]].role not in WAITING_ROLES:
            merged.setdefault(layout.group_id("tp", sink[0]), []).extend(sink)
        else:
            kept.append(sink)
    return kept + list(merged.values())


def _most_waited_on(sinks: list[list[int]], waits_on: list[list[int]]) -> tuple[tuple[int, ...], int]:
    """The roots -- the sink(s) that the most ranks reach -- and how many ranks reach them.

    Equally waited-on sinks (e.g. every rank of a dead machine) are roots together.
    """
    waited_on_by: list[list[int]] = [[] for _ in waits_on]
    for rank, targets in enumerate(waits_on):
        for target in targets:
            waited_on_by[target].append(rank)
    best: list[list[int]] = []
    best_reached: set[int] = set()
    best_reach = 0
    for sink in sinks:
        reached = _ranks_waiting_on(sink, waited_on_by)
        if len(reached) > best_reach:
            best, best_reached, best_reach = [sink], reached, len(reached)
        elif len(reached) == best_reach:
            best.append(sink)
            best_reached = best_reached | reached
    roots = tuple(sorted(rank for sink in best for rank in sink))
    return roots, len(best_reached)


def _ranks_waiting_on(sink: list[int], waited_on_by: list[list[int]]) -> set[int]:
    """The sink's ranks and every rank that waits on them, directly or transitively."""
    reached: set[int] = set(sink)
    todo: list[int] = list(sink)
    while todo:
        rank = todo.pop()
        for waiter in waited_on_by[rank]:
            if waiter not in reached:
                reached.add(waiter)
                todo.append(waiter)
    return reached


def _is_confident(
    roots: tuple[int, ...], reach: int, states: list[RankState], layout: _Layout, cfg: OverEvictionConfig
) -> bool:
    """Enough of the job waits on the roots, there are few enough of them, and busy roots lie in
    one DP replica."""
    world_size = layout.world_size
    confident = (
        reach >= cfg.min_reach_fraction * world_size and len(roots) <= cfg.max_root_fraction * world_size
    )
    if confident and layout.size["dp"] > 1 and any(states[rank].role not in WAITING_ROLES for rank in roots):
        # Busy roots in different DP replicas are ordinary overlap (a pipeline stage computing in
        # every replica at once), not one fault: a faulty rank holds up its own replica while
        # the other replicas finish and wait for it in the DP collective.
        confident = len({layout.coord("dp", rank) for rank in roots}) == 1
    return confident


def _cause(roots: tuple[int, ...], states: list[RankState]) -> str:
    roles = {states[rank].role for rank in roots}
    if roles == {Role.MISSING}:
        return "missing"
    if roles - WAITING_ROLES - {Role.MISSING}:
        return "busy"  # compute, data loading, checkpointing or a local wait
    if roles == {Role.P2P}:
        return "p2p-cycle"  # e.g. a skipped send: two stages each waiting on the other
    return "stuck-collective"


def _classes(class_of: list[int], states: list[RankState]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(signature, ranks) per class, the biggest first (ties: the class of the lowest rank first)."""
    ranks_by_class: dict[int, list[int]] = {}
    for rank, class_id in enumerate(class_of):
        ranks_by_class.setdefault(class_id, []).append(rank)
    items = [(states[ranks[0]].signature, tuple(ranks)) for ranks in ranks_by_class.values()]
    items.sort(key=lambda item: (-len(item[1]), item[1][0]))
    return tuple(items)
