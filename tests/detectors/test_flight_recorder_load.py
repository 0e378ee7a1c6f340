"""Reading Flight Recorder dumps: both formats, the restricted unpickler, names and bad files."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from trainguard.detectors.flight_recorder import FlightRecorderError, load_dump_dir, parse_dump


def _entry(seq: int, state: str = "completed", **kw: object) -> dict[str, object]:
    e: dict[str, object] = {
        "record_id": seq,
        "pg_id": 1,
        "process_group": ["1", "tp"],
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": "gloo:all_reduce",
        "time_created_ns": 1_000 + seq,
        "input_sizes": [[4, 4]],
        "output_sizes": [[4, 4]],
        "state": state,
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": 2_000 + seq if state == "completed" else None,
        "retired": state == "completed",
        "is_p2p": False,
        "frames": [{"name": "all_reduce", "filename": "distributed_c10d.py", "line": 3000}],
    }
    e.update(kw)
    return e


def _dump(entries: list[dict[str, object]], version: str = "2.10") -> dict[str, object]:
    return {
        "version": version,
        "pg_config": {
            "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"},
            "1": {"name": "1", "desc": "tp", "ranks": "[0, 1]"},
        },
        "pg_status": {},
        "entries": entries,
    }


def test_pickle_and_json_read_the_same() -> None:
    doc = _dump([_entry(1), _entry(2, "scheduled")])
    a = parse_dump(pickle.dumps(doc), 0, "p")
    b = parse_dump(json.dumps(doc).encode(), 0, "j")
    assert a.entries == b.entries and a.groups == b.groups
    assert a.groups["1"].ranks == (0, 1) and a.groups["1"].desc == "tp"
    assert [(e.seq, e.completed, e.group) for e in a.entries] == [(1, True, "1"), (2, False, "1")]
    assert a.entries[0].frames == ("all_reduce (distributed_c10d.py:3000)",)


def test_p2p_entries_use_their_own_sequence() -> None:
    e = parse_dump(pickle.dumps(_dump([_entry(0, p2p_seq_id=7, is_p2p=True, profiling_name="gloo:recv")])), 0)
    assert e.entries[0].p2p and e.entries[0].seq == 7


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


def test_a_pickle_naming_code_is_refused() -> None:
    with pytest.raises(FlightRecorderError, match="only plain data"):
        parse_dump(pickle.dumps({"entries": [_Boom()], "version": "2.10"}), 0, "evil")


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "not a Flight Recorder dump"),
        (b"garbage\x00\x01", "not a Flight Recorder dump"),
        (json.dumps({"version": "2.10"}).encode(), "no entries"),
        (json.dumps(_dump([], version="1.5")).encode(), "version '1.5' not supported"),
        (json.dumps(_dump([_entry(1, "weird")])).encode(), "state 'weird'"),
        (
            json.dumps({**_dump([]), "pg_config": {"0": {"ranks": "[0, 'x']"}}}).encode(),
            "not a list of ranks",
        ),
    ],
)
def test_bad_dumps_are_named_errors(data: bytes, match: str) -> None:
    with pytest.raises(FlightRecorderError, match=match):
        parse_dump(data, 0, "f")


def test_a_directory_is_read_by_rank_with_the_prefix_inferred(tmp_path: Path) -> None:
    for r in (0, 1, 10):
        (tmp_path / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(_dump([_entry(1)])))
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / ".nccl_trace_rank_3.tmp").write_text("partial")
    assert sorted(load_dump_dir(tmp_path)) == [0, 1, 10]


def test_two_prefixes_need_one_named(tmp_path: Path) -> None:
    (tmp_path / "a_0").write_bytes(pickle.dumps(_dump([])))
    (tmp_path / "b_0").write_bytes(pickle.dumps(_dump([])))
    with pytest.raises(FlightRecorderError, match="different prefixes"):
        load_dump_dir(tmp_path)
    assert list(load_dump_dir(tmp_path, prefix="b_")) == [0]


def test_an_empty_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FlightRecorderError, match="no dump files"):
        load_dump_dir(tmp_path)


@pytest.mark.parametrize(
    "data",
    [
        b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94\x93\x94.",  # STACK_GLOBAL
        b"cos\nsystem\n(S'echo pwned'\ntR.",  # GLOBAL + REDUCE (protocol 0)
        b"\x80\x02\x82\x01.",  # EXT1: an extension registry code
    ],
)
def test_every_way_a_pickle_names_code_is_refused(data: bytes) -> None:
    with pytest.raises(FlightRecorderError):
        parse_dump(data, 0, "evil")


def test_a_pickle_that_builds_on_a_dict_is_an_error_not_a_crash() -> None:
    with pytest.raises(FlightRecorderError, match="not a Flight Recorder dump"):
        parse_dump(b"\x80\x04}\x94}\x94b.", 0, "f")


def test_shared_sizes_within_the_budget_are_cut_down() -> None:
    sizes = list(range(200))
    doc = _dump([_entry(1, input_sizes=[sizes] * 200)])  # 40,000 elements from a 1 KB pickle
    entry = parse_dump(pickle.dumps(doc), 0).entries[0]
    assert len(entry.input_sizes) == 64 and len(entry.input_sizes[0]) == 16


def test_a_memo_bomb_is_refused() -> None:
    """9 million elements from a 15 KB pickle: over its budget (tests/detectors/test_fr_budget.py)."""
    sizes = list(range(3000))
    doc = _dump([_entry(1, input_sizes=[sizes] * 3000)])
    with pytest.raises(FlightRecorderError, match="expands beyond its budget"):
        parse_dump(pickle.dumps(doc), 0)


@pytest.mark.parametrize("bad", [[1], "x"])
def test_a_pg_config_that_is_not_a_mapping_is_an_error(bad: object) -> None:
    with pytest.raises(FlightRecorderError, match="pg_config must be a mapping"):
        parse_dump(json.dumps({**_dump([]), "pg_config": bad}).encode(), 0, "f")


def test_two_files_of_one_rank_are_an_error(tmp_path: Path) -> None:
    for name in ("rank_01", "rank_1"):
        (tmp_path / name).write_bytes(pickle.dumps(_dump([])))
    with pytest.raises(FlightRecorderError, match="two dumps of rank 1"):
        load_dump_dir(tmp_path)


def test_a_given_prefix_may_end_in_a_digit(tmp_path: Path) -> None:
    for r in (0, 12):
        (tmp_path / f"trace2{r}").write_bytes(pickle.dumps(_dump([])))
    assert sorted(load_dump_dir(tmp_path, prefix="trace2")) == [0, 12]


def test_dump_time_is_the_newest_time_any_entry_carries() -> None:
    """Issue #41: the dump's time comes from its entries (created, seen started, seen completed)."""
    import json as _json

    from trainguard.detectors.flight_recorder import dump_time_ns, parse_dump

    def raw(seq: int, created: int, started: int, completed: int) -> dict[str, object]:
        return {"record_id": seq, "process_group": ["0", "default_pg"], "collective_seq_id": seq,
                "profiling_name": "nccl:all_reduce", "state": "completed", "time_created_ns": created,
                "time_discovered_started_ns": started, "time_discovered_completed_ns": completed}  # fmt: skip

    doc = {"version": "2.10", "pg_config": {}, "entries": [raw(1, 100, 150, 900), raw(2, 950, 0, 0)]}
    d0 = parse_dump(_json.dumps(doc).encode(), 0)
    assert d0.entries[0].started_ns == 150 and d0.entries[1].started_ns is None
    assert d0.newest_ns() == 950
    doc["entries"] = [raw(1, 100, 1200, 0)]
    d1 = parse_dump(_json.dumps(doc).encode(), 1)
    assert dump_time_ns({0: d0, 1: d1}) == 1200  # a started time newer than any creation counts
    assert dump_time_ns({0: parse_dump(b'{"version": "2.10", "entries": []}', 0)}) is None
