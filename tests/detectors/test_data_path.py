"""One test per row of the data path's decision table: each row's detector, driven into the row's
condition, answers with the row's category, kinds and action."""

from __future__ import annotations

import importlib

from trainguard.detectors.data_path import DATA_PATH_ROWS, DataPathRow, row_for
from trainguard.detectors.findings import Finding
from trainguard.detectors.log_classifier import LogClassifier
from trainguard.detectors.slow_data import SlowDataConfig, SlowDataDetector
from trainguard.detectors.training import StallConfig, StepStallDetector
from trainguard.streams.shadow_loader import LoaderEvent


def _hung_loader() -> list[Finding]:
    """Four ranks step every 0.5 s; rank 2's loader hangs at step 40, so it stops stepping and
    the others block in their next collective after step 41."""
    d = StepStallDetector(StallConfig(stall_s=60, precapture_fraction=0.5), job="j")
    for step in range(1, 42):
        for rank in range(4):
            if rank != 2 or step <= 40:
                d.update(rank, step, ts=step * 0.5, step_time_s=0.5)
    alive = dict.fromkeys(range(4), True)
    out = []
    for now in (25.0, 30.0, 40.0):
        f = d.check(now=now, alive=alive)
        if f is not None:
            out.append(f)
    return out


def _slow_loader() -> list[Finding]:
    """Rank 0 waits 5% of each 0.5 s step, then 60% for two minutes, then 5% again."""
    d = SlowDataDetector(SlowDataConfig(), job="j")
    out, t = [], 0.0
    for step in range(600):
        frac = 0.6 if 200 <= step < 300 else 0.05
        step_time = 0.5 / (1 - frac)
        t += step_time
        f = d.observe(0, step, t, step_time, frac * step_time)
        if f is not None:
            out.append(f)
    return out


def _logged(*lines: str) -> list[Finding]:
    """What the log classifier makes of the rank's lines, as the node inspector feeds them."""
    c = LogClassifier()
    out = []
    for i, line in enumerate(lines):
        finding = c.feed(line, ts=100.0 + i, host="n2/trainguard").to_finding(job="j", node="n2")
        if finding is not None:
            out.append(finding)
    return out


def _taken_over() -> list[Finding]:
    """The shadow loader's line for a hung loader it replaced (a real LoaderEvent's)."""
    event = LoaderEvent("takeover", "stalled", stalled_s=1.03, threshold_s=1.0, takeover_s=0.05,
                        from_lane=1, to_lane=2, epoch=2, offset=64, consumed=1184)  # fmt: skip
    return _logged(event.line())


def _gave_up() -> list[Finding]:
    event = LoaderEvent("gave_up", "stalled", stalled_s=1.0, from_lane=5, takeovers=3, epoch=2, offset=64)
    return _logged(event.line())


DRIVERS = {
    "loader hung, shadow loader ready": _taken_over,
    "loader hung, no shadow loader": _hung_loader,
    "loaders keep failing": _gave_up,
    "loader slow": _slow_loader,
}


def test_every_row_has_a_driver() -> None:
    assert sorted(DRIVERS) == sorted(r.condition for r in DATA_PATH_ROWS)
    assert row_for("slow_data").condition == "loader slow"


def _check_row(row: DataPathRow) -> None:
    module, cls = row.detector.rsplit(".", 1)
    assert hasattr(importlib.import_module(module), cls)
    found = DRIVERS[row.condition]()
    assert found, f"{row.condition}: the detector saw nothing"
    assert {f.category for f in found} == {row.category}
    assert {f.action for f in found} == {row.action}
    assert [f.kind for f in found] == list(row.kinds)
    assert found[-1 if row.category == "job_hang" else 0].severity is row.severity
    assert row.why


def test_row_loader_hung() -> None:
    row = row_for("job_hang")
    _check_row(row)
    assert _hung_loader()[-1].ranks == (2,)  # the rank whose loader hung is the one behind


def test_row_loader_slow() -> None:
    _check_row(row_for("slow_data"))


def test_row_loader_taken_over() -> None:
    _check_row(row_for("loader_takeover"))
    (finding,) = _taken_over()
    assert finding.evidence["rule"] == "shadow-loader-takeover" and finding.node == "n2"
    assert (finding.evidence["stalled_s"], finding.evidence["takeover_s"]) == ("1.03", "0.050")


def test_row_loaders_keep_failing() -> None:
    _check_row(row_for("loader_failed"))
