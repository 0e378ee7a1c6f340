"""Every step is told the fault category its recovery answers (a Slurm drain reason names it)."""

from __future__ import annotations

from trainguard.actions.recovery import _category
from trainguard.schemas.control import Decision, Targets
from trainguard.schemas.enums import Action


def test_the_category_is_the_detections() -> None:
    d = Decision(
        decision_id="d1", ts_ms=1, job="j", action=Action.EVICT, targets=Targets(machines=["n2"]),
        evidence={"detection": {"kind": "xid-79", "category": "gpu_unavailable"}},
    )  # fmt: skip
    assert _category(d) == "gpu_unavailable"


def test_without_a_detection_it_is_the_action() -> None:
    d = Decision(
        decision_id="d2", ts_ms=1, job="j", action=Action.RESTART, evidence={"requested_by": "operator"}
    )
    assert _category(d) == "restart"
