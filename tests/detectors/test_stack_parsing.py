"""py-spy dump parsing: real captured dumps (text and --json), format variants, and garbage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.detectors.stacks import (
    DumpName,
    DumpParser,
    Frame,
    StackParseError,
    collect_round,
    load_dump_dir,
)
from trainguard.detectors.stacks.model import normalize_filename

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "stacks"
HANG = FIXTURES / "tp2pp2dp2_compute_hang_last_stage"


def _one(path: Path) -> tuple[DumpName, str]:
    dn = DumpName.parse(path.name)
    assert dn is not None
    return dn, path.read_text()


def _files(directory: Path, pattern: str) -> list[Path]:
    found = sorted(directory.glob(pattern))
    assert found, f"no {pattern} in {directory}"
    return found


def test_real_text_dump_of_a_rank_in_a_collective() -> None:
    # Rank 2 of the captured hang waits in the DP all-reduce of its grads.
    dn, text = _one(_files(HANG, "rank2_pid*.txt")[0])
    (proc,) = DumpParser().parse_text(text, "rank2.txt")
    assert proc.pid == dn.pid
    main = proc.main_thread()
    assert main is not None and main.name == "MainThread" and main.thread_id == dn.pid
    assert main.frames[0] == Frame("all_reduce", "torch/distributed/distributed_c10d.py", main.frames[0].line)
    assert main.frames[0].line > 0
    assert [f.name for f in main.frames][-2:] == ["main", "<module>"]
    assert len(proc.threads) >= 2  # the DataLoader's queue feeder thread is dumped too


def test_real_json_and_text_dumps_of_the_same_process_agree() -> None:
    parser = DumpParser()
    for txt in _files(HANG, "rank*_pid*.txt"):
        (from_text,) = parser.parse_text(txt.read_text(), txt.name)
        (from_json,) = parser.parse_json(txt.with_suffix(".json").read_text(), txt.name)
        assert from_text.pid == from_json.pid
        a, b = from_text.main_thread(), from_json.main_thread()
        assert a is not None and b is not None
        # Two separate samples of a hung process: same frames (the busy root's line may move).
        assert [f.label() for f in a.frames] == [f.label() for f in b.frames]


def test_json_threads_in_any_order_main_thread_found() -> None:
    _dn, text = _one(_files(HANG, "rank0_worker0_pid*.json")[0])
    data = json.loads(text)
    (proc,) = DumpParser().parse_json(json.dumps(list(reversed(data))), "w.json")
    main = proc.main_thread()
    assert main is not None and main.name == "MainThread"
    assert any(f.name == "_worker_loop" for f in main.frames)


def test_frames_are_shared_between_dumps() -> None:
    parser = DumpParser()
    stacks = []
    for txt in _files(HANG, "rank[23]_pid*.txt"):
        (proc,) = parser.parse_text(txt.read_text(), txt.name)
        thread = proc.main_thread()
        assert thread is not None
        stacks.append(thread.frames)
    assert stacks[0][0] is stacks[1][0]  # one Frame object per distinct frame line


def test_text_variants_locals_colours_hex_ids_subprocesses() -> None:
    text = (
        "Process 10: python train.py\n"
        "Python v3.11.7 (/usr/bin/python3.11)\n\n"
        'Thread 0x7F00AB (active+gil): "MainThread"\n'
        "    \x1b[32mforward\x1b[0m (model.py:12)\n"
        "        Arguments:\n"
        "            x: <Tensor at 0x7f>\n"
        "    gloo::transport::tcp::UnboundBuffer::waitRecv(int*) (libgloo.so)\n"
        "Thread 11 (idle)\n"
        "    Condition.wait (/usr/lib/python3.11/threading.py:327)\n"
        "\n"
        "Parent Process 1: torchrun\n"
        "Process 12: python worker\n"
        'Thread 12 (idle): "MainThread"\n'
        "    _worker_loop (torch/utils/data/_utils/worker.py:334)\n"
        "-----\n"
    )
    procs = DumpParser().parse_text(text, "x.txt")
    assert [p.pid for p in procs] == [10, 12]
    main = procs[0].threads[0]
    assert main.thread_id == 0x7F00AB and main.active is True
    assert main.frames == (
        Frame("forward", "model.py", 12),
        Frame("gloo::transport::tcp::UnboundBuffer::waitRecv(int*)", "libgloo.so", 0),
    )
    assert procs[0].threads[1].name == "" and procs[0].threads[1].frames[0].filename == "threading.py"


def test_pid_from_file_name_when_header_missing() -> None:
    text = 'Thread 5 (idle): "MainThread"\n    step (train.py:3)\n'
    (proc,) = DumpParser().parse(text, "txt", "rank0_pid5.txt", pid=5)
    assert proc.pid == 5 and proc.main_thread() is not None


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "no thread stacks"),
        ("Error: Failed to find python version from target process\n", "unexpected line"),
        ("Process 1: x\n    forward (model.py:3)\n", "before any 'Thread' header"),
        ('Process 1: x\nThread 1 (idle): "MainThread"\n    garbage without location\n', "not a frame line"),
        ("Process one: x\n", "malformed process header"),
        ('Thread 1 (idle): "MainThread"\n    f (a.py:1)\n', "no 'Process <pid>:' header"),
        ("\x00\x01binary\xff", "unexpected line"),
    ],
)
def test_garbage_text_raises_with_the_file_name(text: str, fragment: str) -> None:
    with pytest.raises(StackParseError, match=fragment) as err:
        DumpParser().parse_text(text, "rank7_pid70.txt")
    assert "rank7_pid70.txt" in str(err.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{not json", "invalid JSON"),
        ('{"pid": 1}', "expected a JSON list"),
        ("[]", "no thread stacks"),
        ("[1]", "expected a thread object"),
        ('[{"pid": 1, "frames": 3}]', r"\[0\]\.frames: expected a list"),
        ('[{"pid": 1, "frames": [{"name": "f", "filename": "a.py", "line": "x"}]}]', r"frames\[0\]\.line"),
        ('[{"pid": 1, "frames": [{"name": 5, "filename": "a.py"}]}]', "string 'name' and 'filename'"),
        ('[{"pid": "1", "frames": []}]', r"\.pid: expected int"),
        ('[{"frames": []}]', "missing and no pid given"),
    ],
)
def test_garbage_json_raises_with_the_file_name(text: str, fragment: str) -> None:
    with pytest.raises(StackParseError, match=fragment) as err:
        DumpParser().parse_json(text, "rank7_pid70.json")
    assert "rank7_pid70.json" in str(err.value)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400))
def test_arbitrary_text_never_escapes_as_another_error(text: str) -> None:
    for fmt in ("txt", "json"):
        try:
            procs = DumpParser().parse(text, fmt, "fuzz", pid=1)
        except StackParseError as exc:
            assert str(exc).startswith("fuzz")  # every error names its source
        else:
            assert procs and all(p.threads for p in procs)


_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.<>]{0,20}", fullmatch=True)
_files_st = st.from_regex(r"[a-z_]{1,8}(/[a-z_]{1,8}){0,2}\.py", fullmatch=True)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(_names, _files_st, st.integers(0, 5000)), min_size=1, max_size=12))
def test_text_round_trip(frames: list[tuple[str, str, int]]) -> None:
    body = "".join(f"    {n} ({f}:{ln})\n" if ln else f"    {n} ({f})\n" for n, f, ln in frames)
    (proc,) = DumpParser().parse_text(f'Process 9: python\nThread 9 (idle): "MainThread"\n{body}', "rt")
    assert proc.threads[0].frames == tuple(Frame(n, f, ln) for n, f, ln in frames)


def test_normalize_filename_strips_install_prefixes() -> None:
    assert (
        normalize_filename("/opt/conda/lib/python3.10/site-packages/megatron/core/x.py")
        == "megatron/core/x.py"
    )
    assert normalize_filename("/usr/local/lib/python3.12/dist-packages/torch/a.py") == "torch/a.py"
    assert normalize_filename("/usr/lib/python3.11/multiprocessing/queues.py") == "multiprocessing/queues.py"
    assert (
        normalize_filename("/workspace/Megatron-LM/pretrain_gpt.py")
        == "/workspace/Megatron-LM/pretrain_gpt.py"
    )


def test_load_dump_dir_single_round_and_both_formats() -> None:
    (round_,) = load_dump_dir(HANG)
    assert sorted(round_) == list(range(8))
    for rd in round_.values():
        assert rd.main is not None and rd.main.source.endswith(".json")  # json preferred
        assert len(rd.children) == 1  # the DataLoader worker
    (as_text,) = load_dump_dir(HANG, prefer="txt")
    assert all(rd.main is not None and rd.main.source.endswith(".txt") for rd in as_text.values())


def test_load_dump_dir_rounds_in_numeric_order(tmp_path: Path) -> None:
    src = _files(HANG, "rank0_pid*.txt")[0]
    for n in (10, 2):
        d = tmp_path / f"round{n}"
        d.mkdir()
        (d / src.name).write_text(src.read_text())
    (tmp_path / "notes.md").write_text("ignored")
    rounds = load_dump_dir(tmp_path)
    assert len(rounds) == 2 and all(list(r) == [0] for r in rounds)


def test_malformed_file_in_directory_is_named(tmp_path: Path) -> None:
    (tmp_path / "rank0_pid11.txt").write_text("this is not a dump\n")
    with pytest.raises(StackParseError, match=r"rank0_pid11\.txt:1: unexpected line"):
        load_dump_dir(tmp_path)


def test_bad_names_mixed_layouts_and_empty_dirs(tmp_path: Path) -> None:
    (tmp_path / "rank_x.txt").write_text("")
    with pytest.raises(StackParseError, match="not a dump file name"):
        load_dump_dir(tmp_path)
    (tmp_path / "rank_x.txt").unlink()
    with pytest.raises(StackParseError, match="no rank<R>_pid<P>"):
        load_dump_dir(tmp_path)
    (tmp_path / "round0").mkdir()
    (tmp_path / "rank0_pid1.txt").write_text('Thread 1 (idle): "MainThread"\n    f (a.py:1)\n')
    with pytest.raises(StackParseError, match="both round<N>/ folders and dump files"):
        load_dump_dir(tmp_path)
    with pytest.raises(StackParseError, match="not a directory"):
        load_dump_dir(tmp_path / "absent")


def test_two_main_dumps_for_one_rank_is_an_error() -> None:
    text = 'Thread {0} (idle): "MainThread"\n    f (a.py:1)\n'
    with pytest.raises(StackParseError, match="already has a main-process dump"):
        collect_round([("rank0_pid1.txt", text.format(1)), ("rank0_pid2.txt", text.format(2))])


def test_subprocesses_dump_gives_children() -> None:
    text = (
        'Process 1: python\nThread 1 (idle): "MainThread"\n    f (a.py:1)\n'
        'Process 2: python\nThread 2 (idle): "MainThread"\n    _worker_loop (torch/utils/data/_utils/worker.py:3)\n'
    )
    round_ = collect_round([("rank4_pid1.txt", text)])
    assert round_[4].main is not None and round_[4].main.pid == 1
    assert [c.pid for c in round_[4].children] == [2]
