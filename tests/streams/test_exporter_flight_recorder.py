"""The exporter's Flight Recorder collector: captures through the shared directory, PyTorch's
timeout dumps, and (slow) a real 4-rank gloo job whose reporters answer a capture while one rank
computes forever and the others wait in ``all_reduce``.

The fast tests answer requests with real gloo dumps recorded earlier
(``tests/fixtures/flight_recorder``), written by a small thread standing in for the reporters.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.net import free_port
from tests.waiting import wait_until
from trainguard.detectors.flight_recorder import analyze_dumps, event_to_dump, parse_dump
from trainguard.schemas.base import Event
from trainguard.schemas.control import Command, CommandKind
from trainguard.schemas.enums import ProcessRole
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import FlightRecorderDump
from trainguard.streams.exporter.config import FlightRecorderConfig, load_exporter_config
from trainguard.streams.exporter.flight_recorder import (
    NOT_ENABLED,
    STALE_S,
    FlightRecorderCollector,
    read_registrations,
)
from trainguard.streams.exporter.shared_dir import SharedDir
from trainguard.streams.exporter.sources.process import TrackedProcess

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "flight_recorder"
HANG = FIXTURES / "tp2pp2dp2_compute_hang"


def proc(pid: int, rank: int, role: ProcessRole = ProcessRole.MAIN) -> TrackedProcess:
    return TrackedProcess(pid, 1, 0, "python", "S", "python train.py", role, rank)


class Published(list[FlightRecorderDump]):
    """The collector's ``publish``: keeps the events, refuses anything that is not a dump event."""

    def __call__(self, event: Event) -> None:
        assert isinstance(event, FlightRecorderDump)
        self.append(event)

    def by_rank(self) -> dict[int, FlightRecorderDump]:
        out = {e.rank: e for e in self}
        assert len(out) == len(self), f"two events for one rank: {[e.rank for e in self]}"
        return out


class FakeReporters:
    """Answers each request in ``<dir>/requests`` as the ranks' reporters would: ``plan`` maps a
    rank to the bytes of its dump, ``("error", reason)``, or None (never answers)."""

    def __init__(self, fr: Path, plan: dict[int, bytes | tuple[str, str] | None]) -> None:
        self.fr, self.plan = fr, plan
        self.answered: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeReporters:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                names = [n for n in os.listdir(self.fr / "requests") if not n.startswith(".")]
            except FileNotFoundError:
                continue
            for cid in names:
                if cid not in self.answered:
                    self.answered.append(cid)
                    self._answer(cid)

    def _answer(self, cid: str) -> None:
        out = self.fr / "dumps" / cid
        out.mkdir(parents=True, exist_ok=True)
        for rank, what in self.plan.items():
            if what is None:
                continue
            name, data = (
                (f"rank_{rank}.error", what[1].encode())
                if isinstance(what, tuple)
                else (f"rank_{rank}", what)
            )
            tmp = out / f".{name}.tmp"
            tmp.write_bytes(data)
            tmp.rename(out / name)


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    """Pids of live processes standing in for training ranks."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(5)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def register(fr: Path, rank: int, pid: int, job: str = "job-fr") -> None:
    (fr / "ranks").mkdir(parents=True, exist_ok=True)
    (fr / "ranks" / f"{rank}.json").write_text(json.dumps({"rank": rank, "pid": pid, "job": job}))


def collector(
    fr: Path, published: Published, procs: list[TrackedProcess] | None = None, **cfg: float
) -> FlightRecorderCollector:
    # Same pid namespace: a registration is live when its pid is (the fallback has its own test).
    settings = {"wait_s": 1.0, "timeout_poll_s": 0.05, "settle_s": 0.0, "registration_fresh_s": 0.0, **cfg}
    return FlightRecorderCollector(
        FlightRecorderConfig(dir=str(fr), **settings),  # type: ignore[arg-type]
        "node-fr",
        "job-fr",
        lambda: list(procs or []),
        published,
    )


def test_capture_gives_one_answer_per_local_rank(tmp_path: Path, sleepers: list[int]) -> None:
    fr = tmp_path / "fr"
    dump0 = (HANG / "json" / "fr_trace_rank_0").read_bytes()
    expected0 = parse_dump(dump0, 0)
    pids = {0: os.getpid(), 1: sleepers[0], 2: sleepers[1], 5: sleepers[2], 7: sleepers[3]}
    for rank, pid in pids.items():
        register(fr, rank, pid)
    register(fr, 6, dead_pid())  # a killed rank's leftover: not asked, no event
    plan: dict[int, bytes | tuple[str, str] | None] = {
        0: dump0,
        1: b"\x80\x04garbage, not a pickle",
        2: None,  # never answers
        5: ("error", "torch.distributed is not initialized in this process"),
        7: b"{" + b" " * 9000 + b"}",  # over max_bytes
        6: dump0,
    }
    published = Published()
    # Rank 3 runs but never registered (no reporter); its dataloader worker is no rank's answer.
    procs = [proc(os.getpid(), 0), proc(sleepers[4], 3), proc(sleepers[4] + 1, 3, ProcessRole.DATALOADER)]
    col = collector(fr, published, procs, wait_s=0.5, max_bytes=8192)
    t0 = time.monotonic()
    with FakeReporters(fr, plan):
        col.request("cap-1").join(10)
    took = time.monotonic() - t0
    events = published.by_rank()
    assert sorted(events) == [0, 1, 2, 3, 5, 7]
    assert 0.5 <= took < 3.0, took  # waited wait_s for rank 2, not longer

    ok = events[0]
    assert ok.error == "" and ok.capture_id == "cap-1" and ok.trigger == "capture"
    assert (ok.job, ok.node, ok.pid, ok.fr_version) == ("job-fr", "node-fr", os.getpid(), expected0.version)
    assert len(ok.entries) == len(expected0.entries) > 0 and ok.dropped == 0
    assert event_to_dump(ok).entries[-1].op == expected0.entries[-1].op
    assert abs(ok.ts_ms - time.time() * 1000) < 10_000  # the answer file's mtime

    assert "not a Flight Recorder dump" in events[1].error and events[1].pid == sleepers[0]
    assert events[2].error == "no Flight Recorder dump within 0.5s" and events[2].pid == sleepers[1]
    assert events[3].error == NOT_ENABLED and events[3].pid == sleepers[4]
    assert events[5].error == "torch.distributed is not initialized in this process"
    assert "over the 8192-byte limit" in events[7].error
    assert all(e.capture_id == "cap-1" and not e.entries for r, e in events.items() if r)
    # Cleaned up: neither the request nor the answers stay.
    assert not (fr / "requests" / "cap-1").exists() and not (fr / "dumps" / "cap-1").exists()
    assert col.published == 6 and col.errors == 3  # rank 1 unreadable, rank 7 too big, rank 2 silent


def test_capture_keeps_the_newest_entries(tmp_path: Path) -> None:
    fr = tmp_path / "fr"
    register(fr, 4, os.getpid())
    published = Published()
    with FakeReporters(fr, {4: (HANG / "pickle" / "fr_trace_rank_4").read_bytes()}):
        collector(fr, published, max_entries=5).capture("cap-2")
    (ev,) = published
    full = parse_dump((HANG / "pickle" / "fr_trace_rank_4").read_bytes(), 4)
    assert ev.error == "" and len(ev.entries) == 5 and ev.dropped == len(full.entries) - 5
    assert [e.record_id for e in ev.entries] == [e.record_id for e in full.entries[-5:]]


def test_capture_without_reporters_and_stale_leftovers(tmp_path: Path) -> None:
    fr = tmp_path / "fr"
    (fr / "requests").mkdir(parents=True)
    (fr / "dumps" / "old-cap").mkdir(parents=True)
    old = time.time() - STALE_S - 5
    for p in (fr / "requests" / "old-cap", fr / "requests" / "recent-cap"):
        p.write_text("{}")
    for p in (fr / "requests" / "old-cap", fr / "dumps" / "old-cap"):
        os.utime(p, (old, old))
    published = Published()
    col = collector(fr, published, [proc(os.getpid(), 2)])
    t0 = time.monotonic()
    assert col.capture("cap-3") == 1
    assert time.monotonic() - t0 < 0.5  # nobody registered: nothing to wait for
    assert [(e.rank, e.error) for e in published] == [(2, NOT_ENABLED)]
    assert sorted(p.name for p in (fr / "requests").iterdir()) == ["recent-cap"]
    assert not (fr / "dumps" / "old-cap").exists()


def test_capture_id_that_is_no_file_name(tmp_path: Path) -> None:
    fr = tmp_path / "fr"
    register(fr, 0, os.getpid())
    published = Published()
    collector(fr, published).capture("../../etc")
    assert [(e.rank, e.capture_id) for e in published] == [(0, "../../etc")]
    assert "not usable as a file name" in published[0].error
    assert not (fr / "requests").exists()


def test_timeout_dumps_are_published_once_and_deleted(tmp_path: Path) -> None:
    fr = tmp_path / "fr"
    tdir = fr / "timeout"
    tdir.mkdir(parents=True)
    register(fr, 3, os.getpid(), job="job-of-rank-3")
    shutil.copy(HANG / "pickle" / "fr_trace_rank_3", tdir / "rank_3")
    (tdir / "rank_4").write_bytes(b"garbage")
    (tdir / ".rank_5.tmp").write_bytes(b"still being written")
    (tdir / "notes.txt").write_text("not a dump")
    published = Published()
    col = FlightRecorderCollector(
        FlightRecorderConfig(dir=str(fr), timeout_poll_s=0.05, settle_s=0.2),
        "node-fr",
        "",  # an exporter serving any job: the registration names it
        list,
        published,
    )
    assert col.scan_timeouts() == 0  # first sight: not settled yet
    col.start()
    try:
        wait_until(lambda: len(published) == 2, 10, lambda: f"2 timeout events; got {published}")
    finally:
        col.stop()
    events = published.by_rank()
    ok = events[3]
    expected = parse_dump((HANG / "pickle" / "fr_trace_rank_3").read_bytes(), 3)
    assert (ok.trigger, ok.capture_id, ok.pid, ok.error) == ("timeout", "", 0, "")
    assert (ok.job, ok.node) == ("job-of-rank-3", "node-fr")
    assert len(ok.entries) == len(expected.entries)
    assert events[4].trigger == "timeout" and "not a Flight Recorder dump" in events[4].error
    assert sorted(p.name for p in tdir.iterdir()) == [".rank_5.tmp", "bad", "notes.txt"]
    (bad,) = (tdir / "bad").iterdir()
    assert bad.name.startswith("rank_4.") and bad.read_bytes() == b"garbage"
    assert col.errors == 1 and col.health().error_count == 1 and col.health().name == "flight_recorder"


def test_timeout_dump_still_growing_waits(tmp_path: Path) -> None:
    tdir = tmp_path / "fr" / "timeout"
    tdir.mkdir(parents=True)
    published = Published()
    col = collector(tmp_path / "fr", published, settle_s=0.3)
    dump = (HANG / "json" / "fr_trace_rank_1").read_bytes()
    with open(tdir / "rank_1", "wb") as fh:
        fh.write(dump[: len(dump) // 2])
        fh.flush()
        assert col.scan_timeouts() == 0
        time.sleep(0.2)
        fh.write(dump[len(dump) // 2 :])
        fh.flush()
        assert col.scan_timeouts() == 0  # changed: the settle time starts again
    time.sleep(0.35)
    assert col.scan_timeouts() == 1
    assert published[0].error == "" and published[0].rank == 1


def test_config_section_and_directory(tmp_path: Path) -> None:
    cfg = load_exporter_config({"reporter": {"socket": "/run/tg-n1/reporter.sock"}}, environ={})
    assert cfg.flight_recorder == FlightRecorderConfig()
    assert str(cfg.flight_recorder_dir) == "/run/tg-n1/fr"
    cfg = load_exporter_config(
        {"flight_recorder": {"dir": "/x/fr", "wait_s": 2}},
        environ={"TRAINGUARD_EXPORTER__FLIGHT_RECORDER__MAX_ENTRIES": "100"},
    )
    assert (str(cfg.flight_recorder_dir), cfg.flight_recorder.wait_s, cfg.flight_recorder.max_entries) == (
        "/x/fr",
        2.0,
        100,
    )
    from trainguard.schemas.config import ConfigError

    with pytest.raises(ConfigError, match="wait"):
        load_exporter_config({"flight_recorder": {"wait": 2}}, environ={})
    with pytest.raises(ConfigError, match="max_entries"):
        load_exporter_config({"flight_recorder": {"max_entries": 10**9}}, environ={})


def test_service_asks_the_flight_recorder_first_on_a_first_round(tmp_path: Path) -> None:
    from trainguard.infra.config import KafkaConfig
    from trainguard.streams.exporter.service import ExporterService

    cfg = load_exporter_config(
        {
            "state_dir": str(tmp_path / "state"),
            "reporter": {"socket": str(tmp_path / "r.sock")},
            "commands": {"enabled": False},
            "nvml": {"enabled": False},
        },
        environ={},
    )
    service = ExporterService(cfg, KafkaConfig())
    assert service.fr is not None and service.fr.dir == tmp_path / "fr"
    calls: list[tuple[str, str]] = []
    service.fr.request = lambda cid: calls.append(("fr", cid))  # type: ignore[method-assign,assignment,return-value]
    service.stacks.request = lambda cid, *a: calls.append(("stacks", cid))  # type: ignore[method-assign,assignment,return-value]

    def capture(cid: str, **args: object) -> None:
        service.handle(Command(command_id=cid, ts_ms=1, kind=CommandKind.CAPTURE_STACKS, args=dict(args)))

    capture("c1", flight_recorder=True, capture_id="cap-a")
    capture("c2", flight_recorder=True, capture_id="cap-a", first_round=1)  # a later round: stacks only
    capture("c3")  # not asked
    capture("c4", flight_recorder="yes")  # only a JSON true asks
    assert calls == [
        ("fr", "cap-a"),
        ("stacks", "cap-a"),
        ("stacks", "cap-a"),
        ("stacks", "c3"),
        ("stacks", "c4"),
    ]
    assert "flight_recorder" in [h().name for h in service.exporter.extra_health]


# -- a real gloo job -------------------------------------------------------------------------------
JOB_SCRIPT = REPO / "tests" / "fixtures" / "fr_job.py"
WORLD = 4
HUNG_RANK = 2
TORCH_FR_VARS = (
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_real_gloo_job_capture_finds_the_computing_rank(tmp_path: Path) -> None:
    fr = tmp_path / "fr"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(WORLD),
        "OMP_NUM_THREADS": "1",
    }
    # An in-process Reporter of another test may have set these here; the ranks set their own.
    for name in (*TORCH_FR_VARS, "TRAINGUARD_FR_DIR", "TRAINGUARD_FLIGHT_RECORDER"):
        env.pop(name, None)
    logs = [open(tmp_path / f"rank{r}.log", "wb") for r in range(WORLD)]  # noqa: SIM115
    ranks = [
        subprocess.Popen(
            [sys.executable, str(JOB_SCRIPT), "--workdir", str(tmp_path), "--hang-rank", str(HUNG_RANK)],
            env={**env, "RANK": str(r)},
            stdout=logs[r],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for r in range(WORLD)
    ]
    try:
        stuck = tmp_path / f"hung_rank{HUNG_RANK}"

        def rank_log(r: int) -> str:
            return (tmp_path / f"rank{r}.log").read_text(errors="replace")

        def tail() -> str:
            return "\n".join(rank_log(r)[-2000:] for r in range(WORLD))

        wait_until(stuck.exists, 90, lambda: f"rank {HUNG_RANK} to start spinning; logs:\n{tail()}")
        wait_until(lambda: len(list((fr / "ranks").glob("*.json"))) == WORLD, 10, "4 registrations")
        time.sleep(4.0)  # the others wait in all_reduce longer than the analysis' min_stuck_s (3 s)
        assert all(p.poll() is None for p in ranks), tail()

        published = Published()
        col = collector(fr, published, wait_s=10.0)
        t0, t0_ms = time.monotonic(), time.time() * 1000
        assert col.capture("cap1") == WORLD
        took = time.monotonic() - t0
        events = published.by_rank()
        assert sorted(events) == list(range(WORLD))
        assert all(e.error == "" for e in events.values()), {r: e.error for r, e in events.items()}
        assert {e.pid for e in events.values()} == {p.pid for p in ranks}

        dumps = {r: event_to_dump(e) for r, e in events.items()}
        topo = JobTopology(job="job-fr", tp=1, pp=1, dp=WORLD, ranks_per_machine=WORLD, machines=["n1"])
        result = analyze_dumps(dumps, topo, {r: e.ts_ms * 1_000_000 for r, e in events.items()})
        report = {
            "capture_s": round(took, 3),
            # each rank's dump landed this long after the capture started (file mtime)
            "answer_ms_after_request": {r: round(e.ts_ms - t0_ms) for r, e in events.items()},
            "dump_log": [ln for r in range(WORLD) for ln in rank_log(r).splitlines() if "capture cap1" in ln],
            "entries": {r: len(e.entries) for r, e in events.items()},
            "verdict": result.verdict,
            "missing": result.missing_ranks,
            "suspects": result.suspect_ranks,
        }
        print(json.dumps(report, default=list))
        assert result.verdict == "hang", result.to_dict()
        assert HUNG_RANK in result.suspect_ranks + result.missing_ranks, result.to_dict()
        assert not (fr / "requests" / "cap1").exists() and not (fr / "dumps" / "cap1").exists()
    finally:
        for p in ranks:
            if p.poll() is None:
                os.killpg(p.pid, 9)
            p.wait()
        for fh in logs:
            fh.close()


def test_a_fresh_registration_counts_where_its_pid_means_nothing(tmp_path: Path) -> None:
    """A rank in another pid namespace (a pod without hostPID): its pid is not alive here, but
    the reporter keeps its registration fresh, so it is asked; a stale one is a gone rank's."""
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    fr = SharedDir(tmp_path)
    for rank in (0, 1):
        (ranks / f"{rank}.json").write_text(json.dumps({"rank": rank, "pid": 7, "job": "j"}))
    old = time.time() - 60
    os.utime(ranks / "1.json", (old, old))
    assert sorted(read_registrations(fr, lambda pid: False, fresh_s=20.0)) == [0]
    assert read_registrations(fr, lambda pid: False, fresh_s=0.0) == {}
    assert sorted(read_registrations(fr, lambda pid: True, fresh_s=0.0)) == [0, 1]


def test_a_real_nccl_timeout_dump_is_shipped(tmp_path: Path) -> None:
    """The dump PyTorch's NCCL watchdog wrote on a real collective timeout (H100, the reporter's
    TORCH_FR_DUMP_TEMP_FILE): picked up and shipped as it is, the timed-out collective last."""
    tdir = tmp_path / "fr" / "timeout"
    tdir.mkdir(parents=True)
    shutil.copy(REPO / "tests" / "fixtures" / "flight_recorder_nccl" / "timeout" / "rank_0", tdir / "rank_0")
    published = Published()
    cfg = FlightRecorderConfig(dir=str(tmp_path / "fr"), timeout_poll_s=0.05, settle_s=0.0)
    col = FlightRecorderCollector(cfg, "gpu0", "job-nccl", list, published)
    assert col.scan_timeouts() == 1 and len(published) == 1  # settle_s 0: taken at first sight
    (ev,) = published.by_rank().values()
    assert (ev.trigger, ev.job, ev.fr_version, ev.error) == ("timeout", "job-nccl", "2.10", "")
    assert [g.ranks for g in ev.groups] == [[0]]
    last = ev.entries[-1]
    assert (last.seq, last.op, last.state, last.completed_ns) == (11, "nccl:all_reduce", "scheduled", 0)
    assert not (tdir / "rank_0").exists()


def test_a_rank_paused_by_a_tracer_is_waited_for(tmp_path: Path) -> None:
    """A rank in a tracing stop (``t``: the same capture's py-spy pausing it for its stack) is not
    a stopped rank: its dump, written once the pause ends, is the answer.  Taken for stopped, the
    peer of a SIGSTOPped rank lost the dump that named the culprit (own-job bench, local run
    20261128-134502: both ranks answered "stopped" and the capture was judged healthy)."""
    fr = tmp_path / "fr"
    register(fr, 0, os.getpid())
    paused = TrackedProcess(os.getpid(), 1, 0, "python", "t", "python train.py", ProcessRole.MAIN, 0)
    published = Published()
    col = collector(fr, published, [paused], wait_s=5.0)
    with FakeReporters(fr, {0: (HANG / "json" / "fr_trace_rank_0").read_bytes()}):
        col.request("cap-traced").join(10)
    (event,) = published
    assert event.error == "" and event.rank == 0 and event.entries


def test_a_stopped_rank_is_answered_for_at_once(tmp_path: Path, sleepers: list[int]) -> None:
    """A SIGSTOPped rank cannot write its dump: the capture says so at once instead of waiting
    ``wait_s`` for it (the worker's capture waits for every rank's answer, the hang's eviction
    with it)."""
    fr = tmp_path / "fr"
    register(fr, 0, sleepers[0])
    stopped = TrackedProcess(sleepers[0], 1, 0, "python", "T", "python train.py", ProcessRole.MAIN, 0)
    published = Published()
    col = collector(fr, published, [stopped], wait_s=30.0)
    t0 = time.monotonic()
    col.request("cap-stop").join(40)
    assert time.monotonic() - t0 < 5.0
    (event,) = published
    assert event.rank == 0 and event.pid == sleepers[0] and "stopped" in event.error
