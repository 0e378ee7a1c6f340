"""The limits every event field is declared with, chosen to fit where the value is stored.

Each constant is ``bounds`` metadata (``trainguard.schemas.typecheck``): the codec rejects a value outside
it, so an event that decodes can always be encoded again and inserted into ClickHouse
(``infra/clickhouse/migrations``; ``tests/infra/test_schema_columns.py`` checks every integer
column against its field's range).  The ranges are generous for real clusters; the record size
(``trainguard.schemas.codec.MAX_RECORD_BYTES`` and each topic's ``max.message.bytes``) bounds the rest.

* **Timestamps** (every ``*_ts_ms``/``*_ms`` instant): 0 .. 2100-01-01T00:00:00Z in epoch
  milliseconds.  ``ts_ms`` is also stored as ``DateTime('UTC')`` (seconds in a UInt32, up to
  2106-02-07) and turned into Python ``datetime`` objects (up to year 9999) on the way; a value in
  microseconds or nanoseconds (a unit mistake, 1000x too large) is rejected at the door instead of
  failing an insert or a conversion later.
* **Ranks**: 0 .. 10,000,000 (``-1`` where a field says "no rank"), stored as ``Int32``/``UInt32``.
* **Counters** (bytes, errors, sequence numbers): the ``UInt64`` range.
* **Names** (kinds, sources): 256 characters; ids 128; free text 64 Ki characters.  Job and
  node names are names in the strict sense of ``trainguard.schemas.names`` (``[A-Za-z0-9._-]``,
  no leading ``.`` or ``-``; 128 and 253 characters): they become paths, labels and arguments.
* **Lists**: every rank of the largest job (1 Mi) for ranks and machines; per-field elsewhere.
"""

from __future__ import annotations

from trainguard.schemas import names
from trainguard.schemas.typecheck import bounds

#: 2100-01-01T00:00:00Z in epoch milliseconds: the latest accepted instant.
MAX_TS_MS = 4_102_444_800_000
#: The highest rank of a job (its world size is at most ``MAX_RANK + 1``).
MAX_RANK = 10_000_000
#: Most ranks (or machines) one event may list: every rank of a 1M-GPU job.
MAX_RANKS_LISTED = 1 << 20

TS_MS = bounds(0, MAX_TS_MS)
NAME = bounds(max_len=256)
ID = bounds(max_len=128)
TEXT = bounds(max_len=65_536)
U64 = bounds(0, 2**64 - 1)
I64 = bounds(0, 2**63 - 1)
RANK = bounds(0, MAX_RANK)
#: a rank or -1: not tied to a rank (e.g. the kernel log of the node).
RANK_OR_NONE = bounds(-1, MAX_RANK)
PID = bounds(0, 2**31 - 1)
#: a list of ranks (``Array(Int32)``): each a rank.
RANKS = bounds(0, MAX_RANK, max_items=MAX_RANKS_LISTED)
#: a list of names that are not job or node names.
NAMES = bounds(max_len=256, max_items=MAX_RANKS_LISTED)
#: a job name: where it must name one (a job spec's) ...
JOB = bounds(max_len=names.JOB_NAME_MAX, name=names.JOB)
#: ... and where "" says "no job" (a kernel log line of an idle node).
JOB_OR_NONE = bounds(max_len=names.JOB_NAME_MAX, name=names.JOB_OR_NONE)
#: a node name where one must be named (a node check's node) ...
NODE = bounds(max_len=names.NODE_NAME_MAX, name=names.NODE)
#: a node name, or "" where a field may name no node (filled in by the exporter that takes it).
NODE_OR_NONE = bounds(max_len=names.NODE_NAME_MAX, name=names.NODE_OR_NONE)
#: a list of node names (a job's machines, its standbys, a decision's targets): each one there.
NODES = bounds(max_len=names.NODE_NAME_MAX, max_items=MAX_RANKS_LISTED, name=names.NODE)
#: a free-form JSON mapping (evidence, command args, overrides): its strings may quote a whole
#: log line or traceback line, its lists every rank of a job.
JSON = bounds(max_len=1_048_576, max_items=MAX_RANKS_LISTED)
