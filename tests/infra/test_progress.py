"""The progress line of long commands (:mod:`trainguard.infra.progress`): one line rewritten in place on a
terminal, plain lines at an interval in a log, nothing when turned off; a fake stream and clock."""

from __future__ import annotations

import io
import time

import pytest

from trainguard.infra.progress import ENV, INTERVAL_ENV, Progress, fmt_duration, fmt_number, fmt_rate, quiet


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True

    def screen(self) -> list[str]:
        """What a terminal shows after this output: ``\\r`` back to column 0, ``ESC[K`` erases
        to the end of the line."""
        lines, col, text, i = [""], 0, self.getvalue(), 0
        while i < len(text):
            if text.startswith("\x1b[K", i):
                lines[-1] = lines[-1][:col]
                i += 3
                continue
            c = text[i]
            if c == "\r":
                col = 0
            elif c == "\n":
                lines.append("")
                col = 0
            else:
                lines[-1] = lines[-1][:col] + c + lines[-1][col + 1 :]
                col += 1
            i += 1
        return lines


@pytest.fixture(autouse=True)
def _progress_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The operator's own settings must not change what these tests see.
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("TERM", "xterm")


def test_durations_rates_and_numbers_are_short() -> None:
    assert [fmt_duration(s) for s in (0.04, 9.96, 42.4, 185, 3725)] == [
        "0.0s",
        "10.0s",
        "42s",
        "3m05s",
        "1h02m",
    ]
    assert fmt_number(12345) == "12,345" and fmt_number(2.5) == "2.50" and fmt_number(12.34) == "12.3"
    assert fmt_rate(1234.4, "records") == "1,234 records/s"
    assert fmt_rate(2.5, "records") == "2.50 records/s"
    assert fmt_rate(3.0) == "3/s"
    assert fmt_rate(1 / 1260, "runs") == "21m00s each"  # slower than one a second: the time each takes
    assert fmt_rate(0.0) == ""


def test_a_terminal_gets_one_line_rewritten_with_rate_and_eta() -> None:
    clock, out = Clock(), Terminal()
    bar = Progress("replay", total=64, unit="records", stream=out, clock=clock)
    assert bar.tty
    for _ in range(32):
        clock.now += 0.0625
        bar.advance()
    assert "\n" not in out.getvalue()  # one line, rewritten
    # redrawn at most every REFRESH_S, not once per record
    assert 5 <= out.getvalue().count("\r") <= 12
    clock.now += 0.25
    bar.tick()  # what the ticking thread does: the latest count, the time moving on
    assert out.screen() == ["replay: 32/64 records (50%)  [2.2s, 14.2 records/s, ETA 2.2s]"]
    clock.now += 1.75
    bar.update(64)
    bar.close()
    assert out.screen() == ["replay: 64 records  [in 4.0s, 16 records/s]", ""]


def test_a_terminal_line_is_cut_to_its_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "30")
    out = Terminal()
    bar = Progress("stack up", stream=out, clock=Clock())
    bar.phase("kafka: resolving the broker's jars with Maven (once)")
    assert out.screen() == ["stack up: kafka: resolving th"]  # 29 columns: a wrapped line cannot be rewritten


def test_a_log_gets_a_plain_line_per_interval_and_one_at_the_end() -> None:
    clock, out = Clock(), io.StringIO()
    bar = Progress("record", total=1000, unit="records", stream=out, interval_s=10, clock=clock)
    assert not bar.tty
    for _ in range(200):
        clock.now += 0.125
        bar.advance(5)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert lines == [
        "record: 400/1,000 records (40%)  [10s, 40 records/s, ETA 15s]",
        "record: 800/1,000 records (80%)  [20s, 40 records/s, ETA 5.0s]",
        "record: 1,000 records  [in 25s, 40 records/s]",
    ]


def test_a_short_run_in_a_log_is_one_line() -> None:
    clock, out = Clock(), io.StringIO()
    with Progress("replay", total=5, unit="records", stream=out, clock=clock) as bar:
        for _ in range(5):
            clock.now += 0.015625
            bar.advance()
    assert out.getvalue() == "replay: 5 records  [in 0.1s, 64 records/s]\n"


def test_slow_phases_leave_their_line_and_fast_ones_go_away() -> None:
    clock, out = Clock(), Terminal()
    with Progress("stack up", stream=out, clock=clock, summary=False) as bar:
        bar.phase("checking ports")
        clock.now += 0.1
        bar.phase("kafka: resolving the broker's jars with Maven")
        clock.now += 41
        bar.update(detail="87 file(s) downloaded (64.2 MB)")
        bar.phase("kafka: waiting until the broker answers")
        clock.now += 0.5
    assert out.screen() == [
        "stack up: kafka: resolving the broker's jars with Maven  [in 41s]  87 file(s) downloaded (64.2 MB)",
        "",  # the fast phases are gone: the caller prints its own summary
    ]


def test_a_log_keeps_a_phase_that_showed_in_it() -> None:
    clock, out = Clock(), io.StringIO()
    bar = Progress("k8s build", stream=out, interval_s=10, clock=clock, summary=False)
    bar.phase("k8s: building kube-apiserver (1/2)")
    for _ in range(25):
        clock.now += 1
        bar.tick()
    bar.phase("k8s: building kwok (2/2)")
    clock.now += 3
    bar.close()
    assert out.getvalue().splitlines() == [
        "k8s build: k8s: building kube-apiserver (1/2)  [10s]",
        "k8s build: k8s: building kube-apiserver (1/2)  [20s]",
        "k8s build: k8s: building kube-apiserver (1/2)  [in 25s]",
    ]  # kwok took 3 s: under one interval, nothing about it in the log


def test_notes_and_program_output_do_not_mix_with_the_status_line() -> None:
    clock, out, stdout = Clock(), Terminal(), io.StringIO()
    bar = Progress("demo runs", total=3, unit="runs", stream=out, clock=clock)
    bar.update(detail="run 1")
    bar.note("k8s: built")
    bar.echo("run 1: 21.3 min  recovered 12/12", file=stdout)
    assert stdout.getvalue() == "run 1: 21.3 min  recovered 12/12\n"
    # the note on a line of its own, the status line drawn again below it
    assert out.screen() == ["k8s: built", "demo runs: 0/3 runs (0%)  [0.0s]  run 1"]


def test_turned_off_it_writes_nothing_but_the_programs_own_output(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    for bar in (Progress("replay", stream=out, enabled=False, interval_s=0), quiet()):
        with bar, bar.ticking():
            bar.phase("x", total=2)
            bar.advance()
            bar.note("a note")
        assert not bar.enabled
    assert out.getvalue() == ""
    monkeypatch.setenv(ENV, "0")  # the operator's switch beats a caller's enabled=True
    stdout = io.StringIO()
    bar = Progress("replay", stream=out, enabled=True, interval_s=0)
    bar.advance()
    bar.echo("replayed 1 record(s)", file=stdout)
    bar.close()
    assert out.getvalue() == "" and stdout.getvalue() == "replayed 1 record(s)\n"


def test_the_environment_sets_the_interval_and_a_dumb_terminal_gets_a_logs_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "30")
    assert Progress("x", stream=io.StringIO()).interval_s == 30
    monkeypatch.setenv(INTERVAL_ENV, "soon")
    assert Progress("x", stream=io.StringIO()).interval_s == 10
    assert Progress("x", stream=Terminal()).tty
    monkeypatch.setenv("TERM", "dumb")  # an editor's shell: escapes would show as garbage
    assert not Progress("x", stream=Terminal()).tty


def test_an_error_leaves_where_it_stopped_when_it_showed() -> None:
    clock, out = Clock(), io.StringIO()
    with (
        pytest.raises(RuntimeError),
        Progress("replay", 10, "records", stream=out, interval_s=5, clock=clock) as bar,
    ):
        clock.now += 6
        bar.advance(3)
        raise RuntimeError("broker gone")
    assert out.getvalue().splitlines()[-1] == "replay: 3/10 records (30%)  [in 6.0s, 2.0s each] (stopped)"
    out = io.StringIO()
    with pytest.raises(RuntimeError), Progress("stack up", stream=out, interval_s=5, clock=clock):
        raise RuntimeError("port in use")  # at once: the error message alone says it
    assert out.getvalue() == ""


def test_iter_counts_each_item_and_takes_the_total_from_a_list() -> None:
    clock, out = Clock(), io.StringIO()
    bar = Progress("nab", unit="files", stream=out, interval_s=0, clock=clock)
    seen: list[str] = []
    for name in bar.iter(["a.csv", "b.csv"]):
        assert bar.done == len(seen)  # counted once the loop body ran
        seen.append(name)
        clock.now += 1
    assert bar.done == 2 and bar.total == 2
    assert out.getvalue().splitlines() == [
        "nab: 0/2 files (0%)  [0.0s]",
        "nab: 1/2 files (50%)  [1.0s, 1 files/s, ETA 1.0s]",
        "nab: 2/2 files (100%)  [2.0s, 1 files/s]",
    ]


def test_ticking_moves_the_elapsed_time_while_the_caller_blocks() -> None:
    out = io.StringIO()
    with Progress("maven", stream=out, interval_s=0, summary=False) as bar, bar.ticking(every_s=0.01):
        time.sleep(0.2)
    assert len(out.getvalue().splitlines()) >= 3


def test_a_closed_stream_does_not_fail_the_work() -> None:
    out = io.StringIO()
    bar = Progress("replay", stream=out, interval_s=0)
    out.close()
    bar.advance()
    bar.close()
    assert not bar.enabled
