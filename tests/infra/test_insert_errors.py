"""Which failed inserts are worth retrying: real errors of ClickHouse 18.16, chDB (26.x) and the
HTTP client, classified by the store.

Each row is an exception as clickhouse-connect 1.6 raised it (type, ``code`` attribute, exact
text), captured by provoking it: against the embedded 18.16 server (scratch database) and chDB
in-process.  Retryable: try the same rows again later.  Not retryable: the rows are refused for
what they hold, so the sink isolates and dead-letters them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from clickhouse_connect.driver import exceptions as ch

from trainguard.infra.clickhouse.store import (
    StoreError,
    describe_error,
    error_code,
    insert_error_is_retryable,
)

URL = "(for url http://localhost:18123)"


def _caused(exc: BaseException, cause: BaseException) -> BaseException:
    exc.__cause__ = cause
    return exc


def _serialization(column: str, cause: BaseException) -> BaseException:
    # clickhouse-connect's DataError for a value it cannot write, the struct error as its cause.
    return _caused(ch.DataError(f"Unable to create native array for column `{column}`: error"), cause)


def _http_1816(status: int, body: str) -> BaseException:
    # How clickhouse-connect words an 18.16 error response (the server sends no code header).
    return ch.DatabaseError(
        f"HTTP driver received HTTP status {status}, server response: {body}, e.what() = DB::Exception {URL}"
    )


#: (what, the exception, retryable)
CASES: list[tuple[str, Callable[[], BaseException], bool]] = [
    # -- the client cannot serialize a value (both engines: it happens before the server sees it)
    (
        "Int32 out of range",
        lambda: _serialization(
            "ranks", struct.error("'i' format requires -2147483648 <= number <= 2147483647")
        ),
        False,
    ),
    (
        "DateTime after 2106",
        lambda: _serialization("ts", struct.error("'I' format requires 0 <= number <= 4294967295")),
        False,
    ),
    ("DateTime before 1970", lambda: _serialization("ts", struct.error("argument out of range")), False),
    (
        "UInt8 256",
        lambda: _serialization("u8", struct.error("ubyte format requires 0 <= number <= 255")),
        False,
    ),
    (
        "None in Int32",
        lambda: _serialization("a", struct.error("required argument is not an integer")),
        False,
    ),
    (
        "lone surrogate in a String",
        lambda: UnicodeEncodeError("utf-8", "gpu\ud800", 3, 4, "surrogates not allowed"),
        False,
    ),
    ("int too large", lambda: OverflowError("int too big to convert"), False),
    # -- ClickHouse 18.16 over HTTP: no code header, the code is in the text (status 500, 400, 404)
    (
        "18.16: unparsable DateTime",
        lambda: _http_1816(
            400, "Code: 41, e.displayText() = DB::Exception: Cannot parse datetime: (at row 1)\n"
        ),
        False,
    ),
    (
        "18.16: type mismatch",
        lambda: _http_1816(
            500,
            "Code: 53, e.displayText() = DB::Exception: Type mismatch in IN or VALUES section. "
            "Expected: Int32. Got: String",
        ),
        False,
    ),
    (
        "18.16: unparsable input",
        lambda: _http_1816(
            500,
            "Code: 27, e.displayText() = DB::Exception: Cannot parse input: expected \\n before: x\\n: "
            '(at row 1)\n\nRow 1:\nColumn 0,   name: a, type: Int32, parsed text: "12"\n'
            'ERROR: garbage after Int32: "x<LINE FEED>"\n\n',
        ),
        False,
    ),
    (
        "18.16: unknown table",
        lambda: _http_1816(
            404, "Code: 60, e.displayText() = DB::Exception: Table probe_24764013.nosuch doesn't exist."
        ),
        True,
    ),
    (
        "18.16: unknown column",
        lambda: _http_1816(500, "Code: 16, e.displayText() = DB::Exception: No such column zz in table t"),
        True,
    ),
    (
        "18.16: readonly",
        lambda: _http_1816(
            500, "Code: 164, e.displayText() = DB::Exception: Cannot insert into table in readonly mode"
        ),
        True,
    ),
    (
        "18.16: memory limit",
        lambda: _http_1816(
            500,
            "Code: 241, e.displayText() = DB::Exception: Memory limit (for query) exceeded: would use "
            "3.00 MiB (attempt to allocate chunk of 4096 bytes), maximum: 1.91 MiB",
        ),
        True,
    ),
    (
        "18.16: timeout exceeded",
        lambda: _http_1816(
            500,
            "Code: 159, e.displayText() = DB::Exception: Timeout exceeded: elapsed 1.000000044 seconds, "
            "maximum: 1",
        ),
        True,
    ),
    (
        "18.16: too many parts",
        lambda: _http_1816(
            500,
            "Code: 252, e.displayText() = DB::Exception: Too many parts (1). Merges are processing "
            "significantly slower than inserts.",
        ),
        True,
    ),
    # -- the HTTP client: the server away
    (
        "connection refused",
        lambda: ch.OperationalError(
            "Error HTTPConnectionPool(host='localhost', port=1): Max retries exceeded with url: "
            '/?query_id=da4abca4-c26f-449e-b71d-aec1683ffebd (Caused by NewConnectionError("HTTPConnection('
            "host='localhost', port=1): Failed to establish a new connection: [Errno 111] Connection "
            'refused")) executing HTTP request attempt 1 (http://localhost:1)'
        ),
        True,
    ),
    (
        "connection closed without a response",
        lambda: ch.OperationalError(
            "Error ('Connection aborted.', RemoteDisconnected('Remote end closed connection without "
            "response')) executing HTTP request attempt 2 (http://localhost:38723)"
        ),
        True,
    ),
    (
        "read timeout",
        lambda: ch.OperationalError(
            "Error HTTPConnectionPool(host='localhost', port=18123): Read timed out. (read timeout=1) "
            "executing HTTP request attempt 1 (http://localhost:18123)"
        ),
        True,
    ),
    (
        "HTTP 503 after the client's retries",
        lambda: ch.OperationalError(f"HTTP driver received HTTP status 503 {URL}"),
        True,
    ),
    ("HTTP 502 from a proxy", lambda: ch.DatabaseError(f"HTTP driver received HTTP status 502 {URL}"), True),
    # -- chDB (ClickHouse 26.x) server errors
    (
        "chDB: unparsable DateTime",
        lambda: ch.DatabaseError(
            "Code: 41. DB::Exception: Cannot read DateTime: unexpected word: Cannot parse DateTime('UTC') "
            "from String: while executing 'FUNCTION if(isNull(-dummy-0) : 3, ...",
            code=41,
            name="CANNOT_PARSE_DATETIME",
        ),
        False,
    ),
    (
        "chDB: too many partitions for one insert",
        lambda: ch.DatabaseError(
            "Code: 252. DB::Exception: Too many partitions for single INSERT block (more than 100). The "
            "limit is controlled by 'max_partitions_per_insert_block' setting. Large number of partitions "
            "is a common misconception. (TOO_MANY_PARTS)",
            code=252,
            name="TOO_MANY_PARTS",
        ),
        False,
    ),
    (
        "chDB: unknown table",
        lambda: ch.DatabaseError(
            "Code: 60. DB::Exception: Table probe.nosuch does not exist. (UNKNOWN_TABLE)",
            code=60,
            name="UNKNOWN_TABLE",
        ),
        True,
    ),
    (
        "chDB: unknown column",
        lambda: ch.DatabaseError(
            "Code: 16. DB::Exception: No such column zz in table probe.t "
            "(dc9dcc39-0419-4dd3-8fdb-d67050108dca). (NO_SUCH_COLUMN_IN_TABLE)",
            code=16,
            name="NO_SUCH_COLUMN_IN_TABLE",
        ),
        True,
    ),
    # -- the store's own failures
    (
        "store: cannot connect",
        lambda: StoreError("cannot connect to ClickHouse at http://localhost:18123: ..."),
        True,
    ),
    ("store: table not migrated", lambda: StoreError("table trainguard.x does not exist"), True),
    ("store: refused rows", lambda: StoreError("insert into t failed: ...", retryable=False), False),
    # -- Python-level transport errors and anything unknown: wait, never dead-letter
    ("socket reset", lambda: ConnectionResetError(104, "Connection reset by peer"), True),
    ("socket timeout", lambda: TimeoutError("timed out"), True),
    ("disk full (chDB temp file)", lambda: OSError(28, "No space left on device"), True),
    ("unknown", lambda: RuntimeError("something else"), True),
]


@pytest.mark.parametrize(("what", "make", "retryable"), CASES, ids=[c[0] for c in CASES])
def test_insert_failures_are_classified(
    what: str, make: Callable[[], BaseException], retryable: bool
) -> None:
    assert insert_error_is_retryable(make()) is retryable, what


def test_the_code_is_read_from_the_attribute_or_the_text() -> None:
    assert error_code(ch.DatabaseError("whatever", code=241)) == 241
    assert error_code(ch.DatabaseError("server response: Code: 53, e.displayText() = DB::Exception")) == 53
    assert error_code(ch.OperationalError("Error HTTPConnectionPool(...) executing HTTP request")) is None


def test_a_refusal_says_why_with_its_cause() -> None:
    exc = _serialization("ranks", struct.error("'i' format requires -2147483648 <= number <= 2147483647"))
    assert describe_error(exc) == (
        "Unable to create native array for column `ranks`: error "
        "(caused by struct.error: 'i' format requires -2147483648 <= number <= 2147483647)"
    )
    assert describe_error(ValueError("year 146140482 is out of range")) == (
        "ValueError: year 146140482 is out of range"
    )
