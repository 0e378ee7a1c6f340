"""Root cause of a crash cascade: a peer's collective error waits briefly for the exit that caused it,
and among exits that all look like consequences, the first to happen is the cause.

When one rank of a job dies, every rank it talks to fails a moment later with a communication
error ("Connection closed by peer", a gloo/NCCL timeout).  Those errors are consequences, and
often they reach the stream *before* the exit that explains them: in a demo run the bad code
push's ``TypeError`` arrived 60 ms after a peer's gloo error, so the job was first stopped for
stop-time diagnostics (2.5 s) and only then rolled back.

:class:`ExitSettler` holds a *secondary* exit finding for ``settle_s``: one of a category that is
usually another rank's echo (``comm_error``, ``comm_timeout`` by default) or of a rule that is
(``secondary_rules``: NCCL's "remote process exited" and "connection closed", and a plain non-zero
exit with no culprit, which is how a launcher sees a rank that died of a peer's broken connection).
If an exit of another, acting kind (a user exception, an OOM or SIGKILL, a CUDA error...) of the
same job happens within ``settle_s`` of it -- before or after -- the held detection is released
as ``ignore`` with the root cause named in its message: it is recorded, and only the root cause
decides.  Otherwise, when its time is up, the held exits are taken in the order they *happened*
(event time, not arrival): the first is released unchanged -- the root cause, the rank that died
first -- and the ones within ``settle_s`` of it, held or still to come, are its echoes
(``ignore``).  A real network fault is acted on ``settle_s`` later than without the wait.

The killed rank's own exit is what makes this work: a rank killed by SIGKILL reports nothing
itself, and the exporter cannot read the status of a process it did not start.  Its launcher
(``trainguard launch``) reports it, stamped with the time the rank died -- before any survivor's
broken connection -- so the decision names the rank that died first and its machine.

>>> from trainguard.schemas.enums import Action
>>> from trainguard.schemas.control import Detection
>>> s = ExitSettler(SettleConfig(settle_s=1.0))
>>> gloo = Detection(detection_id="g", ts_ms=0, job="j", kind="gloo-error", category="comm_error",
...                  action=Action.DIAGNOSE, node="m2", ranks=[4], source_ts_ms=10_000)
>>> s.offer(gloo, now_ms=10_050)  # held
[]
>>> user = Detection(detection_id="u", ts_ms=0, job="j", kind="user-exception", category="user_code",
...                  action=Action.ROLLBACK, node="m1", ranks=[3], source_ts_ms=10_060)
>>> [(d.detection_id, d.action.value) for d in s.offer(user, now_ms=10_100)]
[('u', 'rollback'), ('g', 'ignore')]
>>> s.release(now_ms=20_000)
[]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trainguard.schemas.control import Detection
from trainguard.schemas.enums import Action
from trainguard.schemas.typecheck import bounds

_RECORD_ONLY = (Action.NONE, Action.IGNORE)


@dataclass(frozen=True)
class SettleConfig:
    """Settings of :class:`ExitSettler`."""

    #: how long a secondary exit waits for its root cause (event time both ways); 0 = no wait.
    settle_s: float = field(default=1.0, metadata=bounds(0, 60))
    #: exit categories that are usually a consequence of another rank's failure ...
    secondary: tuple[str, ...] = ("comm_error", "comm_timeout")
    #: ... and exit rules that are (rule ids: their categories hold real root causes too).
    secondary_rules: tuple[str, ...] = ("nccl-remote", "nccl-conn-closed", "exit-nonzero")


class ExitSettler:
    """Holds secondary exit detections of one job until their root cause is known or time is up."""

    def __init__(self, config: SettleConfig | None = None) -> None:
        self.config = config or SettleConfig()
        #: (release at, wall ms; the detection) of the held secondary exits.
        self.held: list[tuple[int, Detection]] = []
        #: (event ms, "category on node ranks [..]") of recent root causes: acting exits, and held
        #: ones released as the first of their cascade; newest last.
        self.causes: list[tuple[int, str]] = []

    @property
    def _settle_ms(self) -> int:
        return int(self.config.settle_s * 1000)

    def offer(self, det: Detection, now_ms: int) -> list[Detection]:
        """An exit detection: what to emit now (possibly nothing, possibly held ones too)."""
        if det.action in _RECORD_ONLY:
            return [det]
        if self.is_secondary(det):
            cause = self._cause_near(det.source_ts_ms)
            if cause is not None:
                return [_secondary(det, cause)]
            if self._settle_ms <= 0:
                return [det]
            self.held.append((now_ms + self._settle_ms, det))
            return []
        label = _label(det)
        self._add_cause(det.source_ts_ms, label)
        out, keep = [det], []
        for due, held in self.held:
            if abs(held.source_ts_ms - det.source_ts_ms) <= self._settle_ms:
                out.append(_secondary(held, label))
            else:
                keep.append((due, held))
        self.held = keep
        return out

    def is_secondary(self, det: Detection) -> bool:
        """Whether ``det`` is an exit of a kind that is usually another rank's echo."""
        return det.category in self.config.secondary or det.kind in self.config.secondary_rules

    def release(self, now_ms: int) -> list[Detection]:
        """Held detections whose wait is over: no acting root cause came.  In the order they
        happened, the first of a cascade is released unchanged; those within ``settle_s`` of an
        earlier one (released, or still held) are its echoes."""
        due = sorted((d for t, d in self.held if t <= now_ms), key=lambda d: d.source_ts_ms)
        self.held = [(t, d) for t, d in self.held if t > now_ms]
        out = []
        for det in due:
            cause = self._cause_near(det.source_ts_ms) or self._held_before(det.source_ts_ms)
            if cause is not None:
                out.append(_secondary(det, cause))
            else:
                out.append(det)
                self._add_cause(det.source_ts_ms, _label(det))
        return out

    def _add_cause(self, ts_ms: int, label: str) -> None:
        self.causes.append((ts_ms, label))
        # Only causes within reach of a secondary yet to come are worth keeping.
        horizon = max(ts for ts, _ in self.causes) - self._settle_ms
        self.causes = [c for c in self.causes if c[0] >= horizon][-16:]

    def _cause_near(self, ts_ms: int) -> str | None:
        for cause_ms, label in reversed(self.causes):
            if abs(cause_ms - ts_ms) <= self._settle_ms:
                return label
        return None

    def _held_before(self, ts_ms: int) -> str | None:
        """A still-held exit that happened before ``ts_ms``, within ``settle_s``: the earlier rank
        of the cascade, whatever it turns out to echo."""
        earlier = [d for _, d in self.held if ts_ms - self._settle_ms <= d.source_ts_ms < ts_ms]
        return _label(min(earlier, key=lambda d: d.source_ts_ms)) if earlier else None


def _label(det: Detection) -> str:
    return f"{det.category} on {det.node or '?'} ranks {det.ranks}"


def _secondary(det: Detection, cause: str) -> Detection:
    return dataclasses.replace(
        det,
        action=Action.IGNORE,
        message=f"{det.message} (secondary to {cause})",
        evidence={**det.evidence, "secondary_to": cause},
    )
