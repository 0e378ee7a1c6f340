"""Recording a time window of topics to a file, and replaying it into Kafka.

File format: JSON lines, one record each, in timestamp order:
``{"topic", "partition", "offset", "ts_ms", "key", "value"}`` where ``key``/``value`` are UTF-8
text, or ``{"b64": "..."}`` for bytes that are not (garbage is recorded as it was: replaying an
incident must replay its poison too).  Replay preserves keys (hence partitions), order and the
relative timing (scaled by ``speed``; ``speed=0`` sends as fast as possible).

Where a replay goes: into a topic namespace (``namespace="shadow"``, what ``trainguard replay``
does by default), every record to its topic's twin ``trainguard.shadow.<rest>``
(:func:`trainguard.schemas.topics.namespaced`), created first with the registry's partitions and configs.
No live worker and no action service reads a namespace; a shadow worker (``trainguard worker
--namespace shadow``) runs the detection path on it.  ``namespace=""`` writes the topics as
recorded, the live ones: the live action service acts on what it decides from them.

Both report to a :class:`~trainguard.infra.progress.Progress` when given one: records done of the total
(a recording's record count; the offsets between the window's start and the partitions' ends).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from trainguard.infra.bus import BusError, create_topics
from trainguard.infra.config import KafkaConfig
from trainguard.infra.progress import Progress, quiet
from trainguard.schemas.topics import namespaced

#: the namespace ``trainguard replay`` writes to unless told ``--live``.
SHADOW = "shadow"


def _enc(b: bytes | None) -> Any:
    if b is None:
        return None
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(b).decode()}


def _dec(v: Any) -> bytes | None:
    if v is None:
        return None
    if isinstance(v, dict):
        return base64.b64decode(v["b64"])
    return str(v).encode("utf-8")


def record(
    cfg: KafkaConfig,
    topics: list[str],
    since_ms: int,
    out: IO[str],
    until_ms: int | None = None,
    namespace: str = "",
    progress: Progress | None = None,
) -> int:
    """Write every record of ``topics`` with timestamp in [since_ms, until_ms] to ``out``; return count.

    ``namespace``: read the topics' twins in that namespace, written under the names in ``topics``
    (a recording of what a shadow worker decided reads like one of the live topics).
    """
    from kafka import KafkaConsumer, TopicPartition

    bar = progress or quiet()
    named = {namespaced(t, namespace): t for t in topics}

    consumer = KafkaConsumer(**cfg.client_kwargs(), enable_auto_commit=False, group_id=None)
    try:
        parts = []
        for t in named:
            ids = consumer.partitions_for_topic(t)
            if ids is None:
                raise BusError(f"topic {t!r} does not exist")
            parts += [TopicPartition(t, p) for p in sorted(ids)]
        consumer.assign(parts)
        ends = consumer.end_offsets(parts)
        starts = consumer.offsets_for_times(dict.fromkeys(parts, since_ms))
        records = []
        todo = {
            tp: start.offset
            for tp in parts
            if (start := starts.get(tp)) is not None and start.offset < ends[tp]
        }
        # At most this many: records after until_ms are read but not kept.
        window = sum(ends[tp] - offset for tp, offset in todo.items())
        bar.phase(f"reading {len(parts)} partition(s)", window, "records")
        for tp, start_offset in todo.items():
            consumer.seek(tp, start_offset)
            while consumer.position(tp) < ends[tp]:
                for got, recs in consumer.poll(timeout_ms=1000, max_records=5000).items():
                    # Each record against its own partition's end: a partition read earlier (or
                    # not seeked yet) also returns what was written after the window's end.
                    read = [r for r in recs if r.offset < ends[got]]
                    records += [r for r in read if until_ms is None or r.timestamp <= until_ms]
                    bar.advance(len(read))
        records.sort(key=lambda r: (r.timestamp, r.topic, r.partition, r.offset))
        bar.phase("writing", len(records), "records")
        for r in records:
            line = {
                "topic": named.get(r.topic, r.topic),
                "partition": r.partition,
                "offset": r.offset,
                "ts_ms": r.timestamp,
                "key": _enc(r.key),
                "value": _enc(r.value),
            }
            out.write(json.dumps(line, separators=(",", ":")) + "\n")
            bar.advance()
        return len(records)
    finally:
        consumer.close()


def count_records(path: Path) -> int:
    """The records in a recording (its non-blank lines): a replay's total, read before it starts."""
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def read_recording(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict) or not isinstance(rec.get("topic"), str):
                    raise ValueError("not a record object")
            except ValueError as exc:
                raise BusError(f"{path}:{n}: not a recording line ({exc})") from None
            yield rec


def replay(
    cfg: KafkaConfig,
    path: Path,
    speed: float = 1.0,
    topic_map: Callable[[str], str] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    namespace: str = "",
    progress: Progress | None = None,
) -> int:
    """Produce the recording's records in order, keeping keys and (scaled) relative timing.

    ``namespace``: into that topic namespace (its topics are created first); ``""``: the topics
    as recorded (after ``topic_map``).  ``progress``: records sent of the recording's count (a
    paced replay's rate, and so its ETA, follows the recording's own rate).
    """
    from kafka import KafkaProducer

    bar = progress or quiet()
    bar.phase("connecting to Kafka" + (f", creating the {namespace} topics" if namespace else ""))
    mapped = topic_map
    if namespace:
        create_topics(cfg, namespace=namespace)

        def in_namespace(name: str) -> str:
            return namespaced(topic_map(name) if topic_map else name, namespace)

        mapped = in_namespace

    producer = KafkaProducer(**cfg.client_kwargs(), acks="all", linger_ms=5)
    # The count is a pass over the file: only when someone watches.  A phase of its own, so the
    # rate and ETA are the sending's, not the connection's.
    bar.phase("sending", count_records(path) if bar.enabled else None, "records")
    sent = 0
    first_ts: int | None = None
    t0 = time.monotonic()
    try:
        for rec in read_recording(path):
            ts = int(rec.get("ts_ms") or 0)
            if first_ts is None:
                first_ts = ts
            if speed > 0:
                due = (ts - first_ts) / 1000 / speed
                wait = due - (time.monotonic() - t0)
                if wait > 0:
                    producer.flush()
                    sleep(wait)
            topic = mapped(rec["topic"]) if mapped else rec["topic"]
            producer.send(topic, key=_dec(rec.get("key")), value=_dec(rec.get("value")))
            sent += 1
            bar.advance()
        producer.flush()
        return sent
    finally:
        producer.close()
