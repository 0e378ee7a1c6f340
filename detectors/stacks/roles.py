"""Reading one stack: its role, the group kind or pipeline neighbour it waits on, its signature.

:class:`StackReader` applies a :class:`~trainguard.detectors.stacks.patterns.PatternTable` to a thread's
frames and caches the answer per distinct stack, so a job whose 9,600 ranks show a dozen
distinct stacks costs a dozen classifications.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.detectors.stacks.model import Frame
from trainguard.detectors.stacks.patterns import PatternTable, Role, Rule
from trainguard.schemas.enums import ProcessRole


@dataclass(frozen=True, slots=True)
class StackInfo:
    """What one thread stack says.  ``signature`` (frames without line numbers) groups ranks."""

    signature: str
    role: Role
    peer: str | None  # "prev" | "next" | "both": the pipeline neighbour a P2P op waits on
    kind: str | None  # "tp" | "dp" | "pp": the group a collective runs in, when the frames say
    top: str  # the frame that decided the role (or the innermost frame)
    frames: tuple[str, ...]  # frame labels, innermost first, for evidence


@dataclass(frozen=True, slots=True)
class ChildInfo:
    """A helper process of a rank (DataLoader worker, checkpoint writer) and whether it is busy."""

    pid: int
    process: ProcessRole
    busy: bool
    stack: StackInfo


def _first(rules: tuple[Rule, ...], frame: Frame) -> str | None:
    for rule in rules:
        if rule.matches(frame.name, frame.filename):
            return rule.value
    return None


class StackReader:
    """Classifies stacks with a pattern table; results are cached per distinct frame tuple."""

    def __init__(self, patterns: PatternTable | None = None, evidence_frames: int = 8) -> None:
        self.patterns = patterns or PatternTable()
        self.evidence_frames = evidence_frames
        self._cache: dict[tuple[Frame, ...], StackInfo] = {}
        self._child_cache: dict[tuple[Frame, ...], tuple[ProcessRole, bool]] = {}
        self._frame_roles: dict[Frame, str | None] = {}
        # Parsers hand out one shared tuple per distinct stack, so most lookups hit by identity
        # and skip hashing every frame.  The entry keeps the tuple alive: its id stays unique.
        self._by_id: dict[int, tuple[tuple[Frame, ...], StackInfo, tuple[ProcessRole, bool] | None]] = {}

    def _role_of(self, frame: Frame) -> str | None:
        try:
            return self._frame_roles[frame]
        except KeyError:
            role = self._frame_roles[frame] = _first(self.patterns.roles, frame)
            return role

    def read(self, frames: tuple[Frame, ...]) -> StackInfo:
        hit = self._by_id.get(id(frames))
        if hit is not None and hit[0] is frames:
            return hit[1]
        info = self._cache.get(frames)
        if info is None:
            info = self._cache[frames] = self._read(frames)
        self._by_id[id(frames)] = (frames, info, None)
        return info

    def _read(self, frames: tuple[Frame, ...]) -> StackInfo:
        role: Role | None = None
        top = frames[0].label() if frames else "<empty stack>"
        blocked = False
        for f in frames:
            r = self._role_of(f)
            if r is None:
                continue
            if r == Role.WAIT:
                blocked = True
                continue
            role, top = Role(r), f.label()
            break
        if role is None:
            # Only generic waits (or nothing) matched: blocked on something local, else computing.
            role = Role.WAIT if blocked and frames and self._role_of(frames[0]) == Role.WAIT else Role.COMPUTE
        peer = kind = None
        if role == Role.P2P:
            peer = next((v for f in frames if (v := _first(self.patterns.peers, f)) is not None), None)
        if role in (Role.COLLECTIVE, Role.DEVICE_SYNC):
            kind = next((v for f in frames if (v := _first(self.patterns.kinds, f)) is not None), None)
        labels = tuple(f.label() for f in frames)
        return StackInfo(" <- ".join(labels), role, peer, kind, top, labels[: self.evidence_frames])

    def read_child(self, pid: int, frames: tuple[Frame, ...]) -> ChildInfo:
        """Which helper a child process is, and whether it is busy (not parked waiting for work)."""
        hit = self._by_id.get(id(frames))
        if hit is not None and hit[0] is frames and hit[2] is not None:
            return ChildInfo(pid, hit[2][0], hit[2][1], hit[1])
        cached = self._child_cache.get(frames)
        if cached is None:
            cached = self._child_cache[frames] = self._read_child(frames)
        info = self.read(frames)
        self._by_id[id(frames)] = (frames, info, cached)
        return ChildInfo(pid, cached[0], cached[1], info)

    def _read_child(self, frames: tuple[Frame, ...]) -> tuple[ProcessRole, bool]:
        roles = {self._role_of(f) for f in frames}
        if Role.DATALOADER in roles:
            process = ProcessRole.DATALOADER
        elif Role.CHECKPOINT in roles:
            process = ProcessRole.CHECKPOINT
        else:
            process = ProcessRole.OTHER
        for f in frames:
            if self._role_of(f) == Role.WAIT:
                continue
            # The first frame that is not a generic wait: the job loop (idle) or the job (busy).
            return process, _first(self.patterns.idle_loops, f) is None
        return process, False
