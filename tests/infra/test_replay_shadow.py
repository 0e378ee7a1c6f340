"""Replay is safe by default (issue 11, item 7).

``trainguard replay`` writes into the shadow topic namespace (``trainguard.shadow.*``), which no
live worker and no action service reads; ``--live`` writes the live topics.  A shadow worker
(``worker.topic_namespace``) names every topic it reads or writes through the namespace and runs
no ClickHouse sink.  ``trainguard replay --compare`` runs a recording through the offline
detection path with changed worker settings and lists the decisions that differ (no broker).
The slow tests replay into the real broker: the live topic gets nothing, the shadow topic the
records; a real shadow worker decides on them and writes its decision to the shadow decisions
topic only.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

from tests.streams.harness import Watcher, unique
from trainguard.cli import main
from trainguard.detectors.replay import ReplayConfig, decode_records, replay_events
from trainguard.infra.config import Settings
from trainguard.infra.replay import read_recording
from trainguard.schemas.codec import encode
from trainguard.schemas.config import ConfigError, load_config
from trainguard.schemas.control import Decision, JobSpec
from trainguard.schemas.topics import DECISIONS, STEPS, TOPICS, namespaced
from trainguard.schemas.workload import TrainingStep
from trainguard.streams.config import WorkerConfig

INCIDENTS = Path(__file__).resolve().parents[1] / "fixtures" / "incidents"
ROWS: dict[str, dict[str, Any]] = {
    r["fault"]: r for r in yaml.safe_load((INCIDENTS / "expected.yaml").read_text())
}
#: a hang: the stall check decides ``aggregate`` (capture stacks), the capture's verdict ``evict``.
FAULT = "hang"


def cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# --- the namespace ----------------------------------------------------------------------------


def test_every_registry_topic_has_a_distinct_shadow_twin() -> None:
    twins = {namespaced(t.name, "shadow") for t in TOPICS}
    assert len(twins) == len(TOPICS)
    assert all(n.startswith("trainguard.shadow.") for n in twins)
    assert not twins & {t.name for t in TOPICS}
    assert namespaced(DECISIONS.name, "") == DECISIONS.name


@pytest.mark.parametrize("bad", ["a.b", "sh adow", "-", "ß"])
def test_a_namespace_kafka_would_refuse_is_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        namespaced(DECISIONS.name, bad)


def test_a_shadow_worker_has_its_own_app_id_and_no_sink() -> None:
    cfg = WorkerConfig(topic_namespace="shadow")
    assert (cfg.app_id, cfg.sink_enabled) == ("trainguard-worker-shadow", False)
    # sink_enabled: true in the file cannot make a shadow worker write the live tables
    cfg = load_config(WorkerConfig, {"topic_namespace": "shadow", "sink_enabled": True, "app_id": "x"})
    assert (cfg.app_id, cfg.sink_enabled) == ("x", False)
    assert WorkerConfig().sink_enabled and WorkerConfig().app_id == "trainguard-worker"
    with pytest.raises(ConfigError):
        load_config(WorkerConfig, {"topic_namespace": "a.b"})


# What a shadow worker subscribes to, emits and dead-letters is tested on the real broker with a
# real worker: test_a_shadow_worker_decides_on_the_replayed_stream_and_only_there (below).


# --- the offline compare ------------------------------------------------------------------------


def _job(recording: Path) -> str:
    events, _ = decode_records(read_recording(recording))
    return next(e.job for _, e in events if isinstance(e, JobSpec))


def _expected_lines(fault: str, out: Path) -> Path:
    """What the real demo run decided (``expected.yaml``) as ``trainguard decisions --json`` lines."""
    row = ROWS[fault]
    job = _job(INCIDENTS / row["recording"])
    with open(out, "w", encoding="utf-8") as fh:
        for d in row["decisions"]:
            fh.write(json.dumps({"job": job, "action": d["action"], "targets": {"machines": d["machines"]}}))
            fh.write("\n")
    return out


def _worker_yaml(tmp_path: Path, **changes: Any) -> Path:
    section = yaml.safe_load((INCIDENTS / "worker.yaml").read_text())
    for dotted, value in changes.items():
        node = section
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp_path / "shadow.yaml"
    path.write_text(yaml.safe_dump({"worker": section}))
    return path


def _compare(tmp_path: Path, config: Path, *extra: str | Path) -> Result:
    row = ROWS[FAULT]
    return cli(
        "replay",
        "--compare",
        INCIDENTS / row["recording"],
        "--config",
        config,
        "--prior",
        INCIDENTS / row["prior_decisions"],
        *extra,
    )


def test_compare_with_the_recorded_settings_finds_no_difference(tmp_path: Path) -> None:
    expected = _expected_lines(FAULT, tmp_path / "expected.jsonl")
    res = _compare(tmp_path, _worker_yaml(tmp_path), "--expected", expected)
    assert res.exit_code == 0, res.output
    assert res.output.startswith("no difference (2 expected, 2 replayed)"), res.output


def test_compare_lists_the_decisions_a_longer_stall_threshold_drops(tmp_path: Path) -> None:
    expected = _expected_lines(FAULT, tmp_path / "expected.jsonl")
    # The hang lasts about 20 s: with stall_s 120 no stall is seen, so nothing is decided.
    res = _compare(tmp_path, _worker_yaml(tmp_path, monitor__stall__stall_s=120.0), "--expected", expected)
    assert res.exit_code == 1, res.output
    lines = res.output.splitlines()
    removed = [ln.split() for ln in lines if ln.startswith("removed")]
    job = _job(INCIDENTS / ROWS[FAULT]["recording"])
    assert sorted((r[2], r[3]) for r in removed) == [(job, "aggregate"), (job, "evict")], res.output
    assert not [ln for ln in lines if ln.startswith("added")], res.output
    assert lines[-1] == "2 decision(s) differ: 0 added, 2 removed (2 expected, 0 replayed)"


def _with_decisions(recording: Path, decisions: list[Decision], out: Path) -> Path:
    """``recording`` with ``decisions`` on the decisions topic, as `trainguard record` writes it."""
    lines = [*read_recording(recording)]
    for i, d in enumerate(decisions):
        lines.append(
            {
                "topic": DECISIONS.name,
                "partition": 0,
                "offset": i,
                "ts_ms": d.ts_ms,
                "key": d.job,
                "value": encode(d).decode(),
            }
        )
    lines.sort(key=lambda r: int(r["ts_ms"]))
    out.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return out


def test_compare_defaults_to_the_decisions_in_the_recording(tmp_path: Path) -> None:
    row = ROWS[FAULT]
    config = _worker_yaml(tmp_path)
    events, _ = decode_records(read_recording(INCIDENTS / row["recording"]))
    prior, _ = decode_records(read_recording(INCIDENTS / row["prior_decisions"]))
    section = yaml.safe_load(config.read_text())["worker"]
    decided = replay_events(
        events, ReplayConfig.from_worker_section(section), [d for _, d in prior if isinstance(d, Decision)]
    )
    assert [d.action.value for d in decided.decisions] == ["aggregate", "evict"]
    recording = _with_decisions(INCIDENTS / row["recording"], decided.decisions, tmp_path / "rec.jsonl")
    res = cli(
        "replay", "--compare", recording, "--config", config, "--prior", INCIDENTS / row["prior_decisions"]
    )
    assert res.exit_code == 0, res.output
    # one decision added by the changed settings: the recorded ones stay unchanged
    only_aggregate = _with_decisions(
        INCIDENTS / row["recording"], decided.decisions[:1], tmp_path / "rec1.jsonl"
    )
    res = cli(
        "replay",
        "--compare",
        only_aggregate,
        "--config",
        config,
        "--prior",
        INCIDENTS / row["prior_decisions"],
    )
    assert res.exit_code == 1, res.output
    (added,) = [ln for ln in res.output.splitlines() if ln.startswith("added")]
    assert added.split()[2:4] == [decided.decisions[1].job, "evict"], added
    assert decided.decisions[1].reason[:40] in added


def test_an_operators_decision_in_the_recording_is_an_input_not_an_expectation(tmp_path: Path) -> None:
    # user-error.jsonl holds the operator's code update (a restart no detection led to)
    row = ROWS["user-error"]
    res = cli(
        "replay",
        "--compare",
        INCIDENTS / row["recording"],
        "--config",
        _worker_yaml(tmp_path),
        "--prior",
        INCIDENTS / row["prior_decisions"],
        "--expected",
        _expected_lines("user-error", tmp_path / "expected.jsonl"),
    )
    assert res.exit_code == 0, res.output


def test_compare_options_are_checked() -> None:
    rec = INCIDENTS / ROWS[FAULT]["recording"]
    assert CliRunner().invoke(main, ["replay", "--compare", "--live", str(rec)]).exit_code == 2
    assert CliRunner().invoke(main, ["replay", "--config", str(rec), str(rec)]).exit_code == 2
    help_text = cli("replay", "--help").output
    assert "Exit code 0 when none differ, 1 when some do" in " ".join(help_text.split())


# --- through the real broker --------------------------------------------------------------------


def _steps_recording(tmp_path: Path, job: str) -> tuple[list[TrainingStep], Path]:
    """Five training steps of ``job`` as a recording file (``trainguard record`` format)."""
    steps = [
        TrainingStep(ts_ms=1_000 + i, job=job, rank=0, step=i, loss=1.0, step_time_s=1.0) for i in range(5)
    ]
    recording = tmp_path / "steps.jsonl"
    recording.write_text(
        "".join(
            json.dumps(
                {
                    "topic": STEPS.name,
                    "partition": 0,
                    "offset": i,
                    "ts_ms": s.ts_ms,
                    "key": job,
                    "value": encode(s).decode(),
                }
            )
            + "\n"
            for i, s in enumerate(steps)
        )
    )
    return steps, recording


def _end_offsets(settings: Settings, name: str, partitions: int) -> dict[int, int]:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(**settings.kafka.client_kwargs(), group_id=None, enable_auto_commit=False)
    try:
        ends = c.end_offsets([TopicPartition(name, p) for p in range(partitions)])
        return {tp.partition: off for tp, off in ends.items()}
    finally:
        c.close()


def _keys_between(settings: Settings, name: str, start: dict[int, int], end: dict[int, int]) -> list[bytes]:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(**settings.kafka.client_kwargs(), group_id=None, enable_auto_commit=False)
    keys: list[bytes] = []
    try:
        for p, stop in end.items():
            if stop <= start[p]:
                continue
            tp = TopicPartition(name, p)
            c.assign([tp])
            c.seek(tp, start[p])
            while c.position(tp) < stop:
                for recs in c.poll(timeout_ms=1000).values():
                    keys += [r.key for r in recs if r.offset < stop]
        return keys
    finally:
        c.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_replay_by_default_reaches_the_shadow_topics_and_not_the_live_ones(
    stack_settings: Settings, tmp_path: Path
) -> None:
    from trainguard.infra.bus import create_topics

    job = unique("shadow-replay")
    steps, recording = _steps_recording(tmp_path, job)
    shadow = replace(STEPS, name=namespaced(STEPS.name, "shadow"))
    create_topics(stack_settings.kafka, [STEPS], namespace="shadow")
    watcher = Watcher(stack_settings, shadow)
    before = _end_offsets(stack_settings, STEPS.name, STEPS.partitions)
    try:
        res = cli("replay", recording, "--speed", "0")
        assert res.exit_code == 0, res.output
        assert "replayed 5 record(s) into trainguard.shadow.*" in res.output
        watcher.wait_for(lambda e: isinstance(e, TrainingStep) and e.job == job and e.step == len(steps) - 1)
        got = watcher.all(lambda e: isinstance(e, TrainingStep) and e.job == job)
        assert sorted(e.step for e in got if isinstance(e, TrainingStep)) == [s.step for s in steps]
    finally:
        watcher.close()
    after = _end_offsets(stack_settings, STEPS.name, STEPS.partitions)
    # Other tests may write the live topic meanwhile: none of what arrived is ours.
    assert job.encode() not in _keys_between(stack_settings, STEPS.name, before, after)
    # What the shadow namespace holds is recorded under the registry names.
    out = tmp_path / "shadow-steps.jsonl"
    res = cli("record", "--namespace", "shadow", "--topics", STEPS.name, "--since", "2", "--out", out)
    assert res.exit_code == 0, res.output
    mine = [r for r in read_recording(out) if r["key"] == job]
    assert [r["topic"] for r in mine] == [STEPS.name] * 5


@pytest.mark.slow
def test_replay_live_writes_the_live_topics_with_a_warning(stack_settings: Settings, tmp_path: Path) -> None:
    job = unique("live-replay")
    steps, recording = _steps_recording(tmp_path, job)
    watcher = Watcher(stack_settings, STEPS)
    try:
        res = cli("replay", recording, "--speed", "0", "--live")
        assert res.exit_code == 0, res.output
        assert "WARNING: replaying into the LIVE topics" in res.output
        assert "replayed 5 record(s) into the live topics" in res.output
        watcher.wait_for(lambda e: isinstance(e, TrainingStep) and e.job == job and e.step == len(steps) - 1)
        got = watcher.all(lambda e: isinstance(e, TrainingStep) and e.job == job)
        assert sorted(e.step for e in got if isinstance(e, TrainingStep)) == [s.step for s in steps]
    finally:
        watcher.close()
    assert cli("replay", recording, "--namespace", "").exit_code == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_shadow_worker_decides_on_the_replayed_stream_and_only_there(
    stack_settings: Settings, tmp_path: Path
) -> None:
    """An Xid line replayed by default reaches the shadow worker, whose eviction decision lands on
    the shadow decisions topic; nothing of it reaches the live decisions topic."""
    from tests.net import free_port
    from tests.streams.harness import WorkerProcess
    from tests.waiting import wait_until
    from trainguard.schemas.base import now_ms
    from trainguard.schemas.topics import LOGS
    from trainguard.schemas.workload import LogLine

    env = {"TRAINGUARD__WORKER__TOPIC_NAMESPACE": "shadow", "TRAINGUARD__WORKER__CHECK_INTERVAL_S": "1"}
    worker = WorkerProcess(unique("tg-shadow"), free_port(), tmp_path / "worker.log", env)
    worker.start()  # no settings: its readiness probe would go to the live topics
    shadow = Watcher(stack_settings, replace(DECISIONS, name=namespaced(DECISIONS.name, "shadow")))
    live = Watcher(stack_settings, DECISIONS)
    job = unique("shadow-job")
    line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus."
    nodes: list[str] = []
    try:

        def answered() -> bool:  # a fresh line each time: one sent before the group joined is lost
            node = unique("shadow-node")
            nodes.append(node)
            ev = LogLine(node=node, ts_ms=now_ms(), source="kernel", line=line, job=job)
            rec = {"topic": LOGS.name, "partition": 0, "offset": 0, "ts_ms": ev.ts_ms, "key": node}
            path = tmp_path / f"{node}.jsonl"
            path.write_text(json.dumps({**rec, "value": encode(ev).decode()}) + "\n")
            res = cli("replay", path, "--speed", "0")
            assert res.exit_code == 0, res.output
            try:
                shadow.wait_for(lambda e: isinstance(e, Decision) and node in e.targets.machines, 3.0)
                return True
            except AssertionError:
                return False

        wait_until(answered, 120, lambda: f"a shadow decision:\n{worker.log_tail()}", interval_s=0)
        decided = [e for e in shadow.seen if isinstance(e, Decision) and e.job == job]
        assert decided and all(d.action.value == "evict" for d in decided), decided
        assert not live.all(lambda e: isinstance(e, Decision) and e.job == job, settle_s=2.0)
        health = worker.healthz()
        assert health is not None and health["sink_lag"] is None, health  # no ClickHouse sink
    finally:
        shadow.close()
        live.close()
        worker.stop()
