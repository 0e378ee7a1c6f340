"""The signed control plane against the real broker: with ``signing.enabled`` the action service
acts only on decisions and job specs signed by a trusted key, and dead-letters (stage ``auth``)
the unsigned, the forged, the expired and the replayed ones."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from kafka import KafkaProducer

from tests.actions.conftest import Running, job_spec, make_decision
from tests.streams.harness import Watcher, send, unique
from tests.waiting import wait_until
from trainguard.actions.state import RecoveryState
from trainguard.infra.bus import EventProducer, signer_for
from trainguard.infra.config import Settings
from trainguard.infra.signing import Signer, SigningConfig, init_keys
from trainguard.schemas.base import now_ms
from trainguard.schemas.codec import encode
from trainguard.schemas.control import DeadLetter, Decision
from trainguard.schemas.enums import Action
from trainguard.schemas.topics import DEAD_LETTERS, DECISIONS, JOBS

pytestmark = pytest.mark.slow
Start = Callable[..., Running]


@pytest.fixture
def signed(stack_settings: Settings, tmp_path: Path) -> Settings:
    keys = tmp_path / "keys"
    init_keys(keys)
    return replace(stack_settings, signing=SigningConfig(enabled=True, keys_dir=str(keys)))


def _send_raw(
    settings: Settings, topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]]
) -> None:
    p = KafkaProducer(**settings.kafka.client_kwargs())
    try:
        p.send(topic, key=key, value=value, headers=headers).get(timeout=30)
    finally:
        p.close()


def _auth_letters(w: Watcher, job: str, n: int) -> list[DeadLetter]:
    def enough() -> list[DeadLetter] | None:
        got = [e for e in w.all(lambda e: isinstance(e, DeadLetter) and e.key == job and e.stage == "auth")]
        letters = [e for e in got if isinstance(e, DeadLetter)]
        return letters if len(letters) >= n else None

    return wait_until(enough, 60, f"{n} auth dead letters for {job}")


def test_only_authentic_decisions_and_specs_are_acted_on(
    start_service: Start, signed: Settings, tmp_path: Path
) -> None:
    job = unique("job-signed")
    run = start_service([job], settings=signed)
    dead = Watcher(signed, DEAD_LETTERS)
    operator = signer_for(signed, "operator")
    assert operator is not None
    try:
        # A spec nobody signed never becomes the job's spec; the operator's does.
        unsigned_spec = job_spec(job, n=8)
        EventProducer(signed.kafka).send(unsigned_spec, JOBS).get(timeout=30)
        send(signed, job_spec(job, n=4))  # the harness signs as the operator
        wait_until(lambda: run.service.store.spec(job) is not None, 30, "the signed spec")

        def decision(machine: str) -> tuple[Decision, bytes, bytes]:
            d = make_decision(job, Action.EVICT, [f"{job}-{machine}"])
            return d, DECISIONS.key_of(d), encode(d)

        unsigned, _, _ = decision("n1")
        EventProducer(signed.kafka).send(unsigned, DECISIONS).get(timeout=30)

        rogue_keys = tmp_path / "rogue"
        init_keys(rogue_keys, ["operator"])
        rogue = Signer.load(SigningConfig(enabled=True, keys_dir=str(rogue_keys)), tmp_path, "operator")
        forged, _, _ = decision("n2")
        EventProducer(signed.kafka, signer=rogue).send(forged, DECISIONS).get(timeout=30)

        expired, key, value = decision("n3")
        old_headers = operator.headers(DECISIONS.name, key, value, now_ms=now_ms() - 3_600_000)
        _send_raw(signed, DECISIONS.name, key, value, old_headers)

        tampered, key, value = decision("n4")
        headers = operator.headers(DECISIONS.name, key, value)
        _send_raw(signed, DECISIONS.name, key, value.replace(b"n4", b"n5"), headers)

        valid, key, value = decision("n0")
        headers = operator.headers(DECISIONS.name, key, value)
        _send_raw(signed, DECISIONS.name, key, value, headers)
        _send_raw(signed, DECISIONS.name, key, value, headers)  # captured and sent again

        rec = run.wait(valid.decision_id)
        assert rec.state is RecoveryState.SUCCEEDED
        letters = _auth_letters(dead, job, 6)
        reasons = " | ".join(d.reason for d in letters)
        assert {d.topic for d in letters} == {DECISIONS.name, JOBS.name}
        for word in ("unsigned", "unknown key", "expired", "signature", "replayed"):
            assert word in reasons.lower(), (word, reasons)
        for d in (unsigned, forged, expired, tampered):
            assert run.service.store.get(d.decision_id) is None
        assert [c["args"]["machines"] for c in run.calls("evict", job)] == [[f"{job}-n0"]]
        spec = run.service.store.spec(job)
        assert spec is not None and spec.topology.num_machines == 4
    finally:
        dead.close()
