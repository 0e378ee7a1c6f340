"""The pure decisions behind the action service moving past bad records (fast, no servers).

What is decided from plain values is tested here: which errors mean the world is down and which
mean the record is bad (:func:`trainguard.actions.service.transient`), what the decoder turns a bad decision
record into (:func:`trainguard.infra.bus.decode_record`), and that the progress store (SQLite, the service's
own file) keeps nothing it could not read back.  What the service does with them on the broker --
dead-lettering, committing past, seeking back and reading again, the broker going away -- is
tested against real brokers in ``test_bad_records_live.py``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.actions.conftest import make_decision
from trainguard.actions.progress import ProgressStore
from trainguard.actions.service import transient
from trainguard.infra.bus import decode_record
from trainguard.schemas.codec import DecodeError, encode
from trainguard.schemas.control import DeadLetter, Decision
from trainguard.schemas.enums import Action
from trainguard.schemas.topics import DECISIONS

JOB = "job-bad"


def decision_bytes(d: Decision, **replace: str) -> bytes:
    """``d`` on the wire, with JSON text substituted (to write what ``encode`` refuses to)."""
    text = encode(d).decode()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    return text.encode()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ProgressStore]:
    st = ProgressStore(tmp_path / "progress.sqlite")
    yield st
    st.close()


def test_transient_tells_the_world_down_from_a_bad_record() -> None:
    assert transient(sqlite3.OperationalError("database is locked")) and transient(OSError("disk full"))
    assert not transient(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"))
    assert not transient(ValueError("Exceeds the limit (4300 digits)")) and not transient(KeyError("x"))


def test_the_store_never_keeps_what_it_cannot_read_back(store: ProgressStore) -> None:
    d = make_decision(JOB, Action.EVICT, ["m1"])
    bad = Decision(**{**d.__dict__, "reason": "te\ud800st"})
    with pytest.raises((ValueError, DecodeError)):  # encode's UnicodeEncodeError, or the read-back
        store.accept(bad, 1)
    assert store.get(d.decision_id) is None
    assert store.accept(d, 2) and store.get(d.decision_id) is not None  # the good one still goes in


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(
            decision_bytes(
                make_decision(JOB, Action.EVICT, ["m1"]), **{'"reason":"test"': '"reason":"te\\ud800st"'}
            ),
            id="lone-surrogate",
        ),
        pytest.param(
            decision_bytes(
                make_decision(JOB, Action.EVICT, ["m1"]),
                **{'"evidence":{}': '"evidence":{"n":' + "1" * 4301 + "}"},
            ),
            id="4301-digit-integer",
        ),
        pytest.param(b"\xff\x00", id="not-utf8"),
        pytest.param(
            decision_bytes(make_decision(JOB, Action.EVICT, ["m1"]), **{'"job":"job-bad"': '"job":"../x"'}),
            id="job-name-a-path",
        ),
        pytest.param(
            decision_bytes(make_decision(JOB, Action.EVICT, ["m1"]), **{'["m1"]': '["m1/../m2"]'}),
            id="node-name-a-path",
        ),
    ],
)
def test_an_undecodable_decision_becomes_a_dead_letter_with_its_coordinates(value: bytes) -> None:
    """What the consumer publishes (stage ``decode``) instead of handing the service an event."""
    rec = SimpleNamespace(topic=DECISIONS.name, partition=2, offset=7, key=JOB.encode(), value=value)
    out = decode_record(rec)
    assert isinstance(out, DeadLetter)
    assert (out.stage, out.topic, out.partition, out.offset, out.key) == ("decode", DECISIONS.name, 2, 7, JOB)
    assert out.reason and out.reason.isprintable()
    encode(out)  # the dead letter itself always goes on the wire (no lone surrogate in it)
