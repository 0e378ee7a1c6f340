"""The HTML postmortem report: built from ClickHouse, rendered by a real headless Chromium.

The browser test leaves its screenshot in ``build/test-artifacts/report.png`` to look at, and
reads what the page recorded about its own rendering (``#tg-render-check``): the plots drawn,
the incidents shaded on the training curve, and any JavaScript error.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from trainguard.actions.node_return import TransitionStore
from trainguard.infra.clickhouse.store import ClickHouseStore
from trainguard.infra.config import Settings
from trainguard.infra.report import data as report_data
from trainguard.infra.report.render import PHASE_COLOURS, render
from trainguard.schemas.control import ActionEvent, ActionPhase, Decision, Detection, Targets
from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.nodes import Cause, NodeState, NodeTransition
from trainguard.schemas.workload import TrainingStep

T0 = 1_795_000_000_000
ARTIFACTS = Path(__file__).resolve().parents[2] / "build" / "test-artifacts"


def _job_events(job: str, incidents: list[tuple[int, str, str]], stall_s: int = 10) -> list[object]:
    """A 5-minute job stepping every 0.5 s; each incident (at second s, machine, category) stalls
    it ``stall_s`` seconds, restarts it 20 steps back (recomputed), and is recovered."""
    events: list[object] = []
    t_ms, step = T0, 0
    pending = sorted(incidents)
    while t_ms < T0 + 300_000:
        if pending and t_ms >= T0 + pending[0][0] * 1000:
            _at, machine, category = pending.pop(0)
            n = len(incidents) - len(pending)
            evid = {
                "analysis": {
                    "verdict": "hang",
                    "decided_by": "both",
                    "evidence": {
                        "reason": f"8/8 ranks wait on rank(s) [{n}]",
                        "classes": [
                            {"count": 7, "frames": ["all_reduce (torch/distributed/distributed_c10d.py)"],
                             "process": "main", "ranks": [0, 1, 2, 3, 4, 5, 7], "role": "collective",
                             "suspect": False},
                            {"count": 1, "frames": ["hang_forever (faults.py)"], "process": "main",
                             "ranks": [n], "role": "compute", "suspect": True},
                        ],
                    },
                }
            }  # fmt: skip
            events += [
                Detection(detection_id=f"{job}-det{n}", ts_ms=t_ms + 800, job=job, kind=f"{category}-rule",
                          category=category, severity=Severity.CRITICAL, action=Action.EVICT, node=machine,
                          source_ts_ms=t_ms),
                Decision(decision_id=f"{job}-dec{n}", ts_ms=t_ms + 1200, job=job, action=Action.EVICT,
                         targets=Targets(machines=[machine], group_kind="pp"), detection_ids=[f"{job}-det{n}"],
                         reason=f"{category} on {machine}", evidence=evid),
                ActionEvent(event_id=f"{job}-a{n}-e", decision_id=f"{job}-dec{n}", ts_ms=t_ms + 2000, job=job,
                            step="evict", phase=ActionPhase.SUCCEEDED, action=Action.EVICT,
                            targets=Targets(machines=[machine])),
                ActionEvent(event_id=f"{job}-a{n}-s", decision_id=f"{job}-dec{n}", ts_ms=t_ms + 3000, job=job,
                            step="swap_standbys", phase=ActionPhase.SUCCEEDED, action=Action.EVICT,
                            detail=f"['{machine}'] -> ['s{n}']", duration_ms=900.0),
                ActionEvent(event_id=f"{job}-a{n}-r", decision_id=f"{job}-dec{n}", ts_ms=t_ms + 6000, job=job,
                            step="recovery", phase=ActionPhase.SUCCEEDED, action=Action.EVICT),
            ]  # fmt: skip
            t_ms += stall_s * 1000
            step = max(0, step - 20)
        t_ms += 500
        events.append(
            TrainingStep(job=job, rank=0, step=step, ts_ms=t_ms, step_time_s=0.5, loss=3.0 / (1 + step / 100))
        )
        step += 1
    return events


INCIDENTS = [(40, "m1", "gpu_unavailable"), (120, "m2", "job_hang"), (200, "m3", "network_error")]
TAKEOVER = (
    "trainguard shadow loader: took over from loader 1 (stalled: no batch for 1.02 s, threshold 1.00 s) "
    "with loader 2 in 0.041 s at epoch 3 sample 120 (consumed 9000)"
)


def _takeover(job: str) -> Detection:
    """A hung loader on m2 that rank 4's shadow loader took over at second 160 (no decision)."""
    return Detection(
        detection_id=f"{job}-loader", ts_ms=T0 + 160_400, job=job, kind="shadow-loader-takeover",
        category="loader_takeover", severity=Severity.WARNING, action=Action.IGNORE, node="m2",
        source_ts_ms=T0 + 160_000,
        evidence={"rule": "shadow-loader-takeover", "line": TAKEOVER, "rank": 4, "reason": "stalled",
                  "stalled_s": "1.02", "takeover_s": "0.041"},
    )  # fmt: skip


@pytest.fixture
def report_store(store: ClickHouseStore) -> ClickHouseStore:
    store.insert_events(
        [
            *_job_events("job", INCIDENTS),
            *_job_events("job-baseline", INCIDENTS, stall_s=60),
            _takeover("job"),
        ]
    )
    return store


def test_report_data_from_the_named_queries(report_store: ClickHouseStore) -> None:
    # an evicted machine's way back (trainguard nodes), and a node the job never evicted
    way_back = [
        ("m1", NodeState.EVICTED, Cause.EVICTION, "d1"),
        ("m1", NodeState.VALIDATING, Cause.REPAIRED, "alice"),
    ]
    TransitionStore(report_store).record(
        [
            NodeTransition(f"t{i}", node, T0 + 200_000 + i, i, "", state, cause, by)
            for i, (node, state, cause, by) in enumerate(
                [*way_back, ("x9", NodeState.EVICTED, Cause.EVICTION, "d9")]
            )
        ]
    )
    data = report_data.load(report_store, "job", baseline="job-baseline")
    assert [(t["node"], t["to_state"], t["by"]) for t in data.node_transitions] == [
        ("m1", "evicted", "d1"),
        ("m1", "validating", "alice"),
    ]
    assert [i["category"] for i in data.incidents] == ["gpu_unavailable", "job_hang", "network_error"]
    assert all(i["outcome"] == "succeeded" and i["steps"] for i in data.incidents)
    # the procedure ended 6 s after the fault, the job stepped again 10.5 s after it
    assert {(i["recovered_s"], i["procedure_s"]) for i in data.incidents} == {(10.5, 4.8)}
    assert [e["machine"] for e in data.evictions] == ["m1", "m2", "m3"]
    assert len(data.standbys) == 3
    assert data.baseline is not None
    assert float(data.baseline.ettr["ettr"]) < float(data.job.ettr["ettr"]) < 1.0
    assert data.job.cumulative[-1][1] == pytest.approx(float(data.job.ettr["ettr"]), abs=0.01)
    assert [(r["node"], r["rank"], r["event"], r["stalled_s"], r["takeover_s"]) for r in data.loaders] == [
        ("m2", 4, "loader_takeover", 1.02, 0.041)
    ]
    page = render(data)
    assert page.count("id='dec-") == 3 and "hang_forever (faults.py)" in page
    assert "<td>loader_takeover</td>" in page and ">0.041<" in page  # the data-loader table
    assert "<td>validating</td><td>repaired</td><td>alice</td>" in page  # the way back
    # nothing fetched at view time: no external script, style sheet or image
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=[\"']?https?:", page)


def test_phases_and_downsampling_are_bounded() -> None:
    inc = {"source_ts_ms": 0, "detected_ts_ms": 10, "decided_ts_ms": 10, "localised_s": None,
           "recovered_ts_ms": 0, "ended_ts_ms": 0}  # fmt: skip
    assert report_data.phases(inc, 50) == [("detect", 0, 10), ("recover", 10, 50)]  # still recovering
    # stepping again before the procedure's end (its replenish step still runs): no resume phase
    stepping = {**inc, "ended_ts_ms": 40, "recovered_ts_ms": 30}
    assert report_data.phases(stepping, 50) == [("detect", 0, 10), ("recover", 10, 30)]
    rows = list(range(12_345))
    thin = report_data.downsample(rows)
    assert len(thin) <= report_data.MAX_POINTS + 1 and thin[0] == 0 and thin[-1] == 12_344


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed: scripts/setup.sh installs Debian's chromium")
    return exe


def _browser(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000", *args],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip


@pytest.fixture
def server_store(stack_settings: Settings) -> Iterator[ClickHouseStore]:
    """The report's data on the ClickHouse server only: one engine is enough for the browser (the
    data test above runs on both)."""
    st = ClickHouseStore(replace(stack_settings.clickhouse, database=f"tgtest_{uuid.uuid4().hex[:10]}"))
    st.migrate()
    st.insert_events(
        [
            *_job_events("job", INCIDENTS),
            *_job_events("job-baseline", INCIDENTS, stall_s=60),
            _takeover("job"),
        ]
    )
    yield st
    st.command(f"DROP DATABASE IF EXISTS {st.cfg.database}")
    st.close()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_report_renders_in_a_real_browser(server_store: ClickHouseStore, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(render(report_data.load(server_store, "job", baseline="job-baseline")))
    dom = _browser("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    m = re.search(r'<div id="tg-render-check"([^>]*)>', dom.stdout)
    assert m, "the page's render check did not run"
    attrs = dict(re.findall(r'data-([\w-]+)="([^"]*)"', m.group(1)))
    assert attrs.get("done") == "1", attrs
    errors = json.loads(attrs["errors"].replace("&quot;", '"'))
    assert errors == [], errors
    assert "Uncaught" not in dom.stderr, dom.stderr[-2000:]
    assert int(attrs["plots"]) == 3
    assert int(attrs["incidents"]) == len(INCIDENTS)
    # every incident's phases were drawn: detect, localise, recover, resume (no decide-only phase)
    assert int(attrs["svg-shapes"]) == 4 * len(INCIDENTS)
    assert set(PHASE_COLOURS) >= {"detect", "localise", "recover", "resume"}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "report.png"
    shot.unlink(missing_ok=True)
    res = _browser("--window-size=1400,2400", f"--screenshot={shot}", page.as_uri())
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    head = shot.read_bytes()
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and len(head) > 50_000  # a blank page compresses to ~10 KB
