"""``nccl-tests``: NVIDIA's ``all_reduce_perf`` (github.com/NVIDIA/nccl-tests) across the node's
GPUs when it is on PATH; its table parsed into rows, wrong elements and bus bandwidth.

``all_reduce_perf -b MIN -e MAX -f FACTOR -g GPUS`` prints comment lines (``#``) -- among them the
column header (``# size count type redop root time algbw busbw #wrong time algbw busbw #wrong``:
out-of-place, then in-place) -- one row per size, then ``# Out of bounds values : N OK`` and
``# Avg bus bandwidth : X``.  Older releases have no ``root`` column and an ``error`` column (the
largest relative error, a float) instead of ``#wrong``; with validation off (``-c 0``) ``#wrong``
reads ``N/A``.  :func:`parse_nccl_tests` reads the header to find the columns, so both layouts
parse; it is pure, and tested on sample text.

A row with wrong elements, out-of-bounds values, a non-zero exit, no rows,
or a peak bus bandwidth under ``expected_busbw_gbps * min_fraction`` fails the test.  Skipped when
the binary is not installed.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from typing import Any

from trainguard.diag.base import DiagContext, DiagResult, Skipped, register
from trainguard.diag.config import NcclTestsConfig
from trainguard.diag.devices import gpu_count
from trainguard.diag.tools import run_tool

_OUT_OF_BOUNDS = re.compile(r"#\s*Out of bounds values\s*:\s*(\d+)")
_AVG_BUSBW = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")
#: the per-direction columns after the row's leading ones, in the header's order.
_TIMED = ("time", "algbw", "busbw")


@dataclass
class NcclRow:
    size: int
    count: int
    type: str
    redop: str
    #: "out_of_place" / "in_place" -> {"time_us", "algbw_gbps", "busbw_gbps", "wrong" or "error"}.
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "count": self.count,
            "type": self.type,
            "redop": self.redop,
            **self.results,
        }


@dataclass
class NcclReport:
    rows: list[NcclRow] = field(default_factory=list)
    out_of_bounds: int | None = None
    avg_busbw_gbps: float | None = None

    @property
    def peak_busbw_gbps(self) -> float | None:
        values = [r["busbw_gbps"] for row in self.rows for r in row.results.values() if "busbw_gbps" in r]
        return max(values) if values else None

    def wrong_rows(self) -> list[tuple[int, str, int]]:
        """(size, direction, wrong elements) of every row that reported some.  An older release's
        ``error`` (the largest rounding error, normally ~1e-7 for a float sum) is recorded only:
        its values past the tolerance are counted in ``out_of_bounds``."""
        return [
            (row.size, direction, r["wrong"])
            for row in self.rows
            for direction, r in row.results.items()
            if isinstance(r.get("wrong"), int) and r["wrong"] > 0
        ]


def _number(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


def _header(line: str) -> list[str] | None:
    """The column names of a header line (``# size count type ...``), else None."""
    tokens = line.lstrip("#").split()
    if tokens[:2] == ["size", "count"] and "busbw" in tokens:
        return tokens
    return None


def parse_nccl_tests(text: str) -> NcclReport:
    """Rows, out-of-bounds count and average bus bandwidth of an nccl-tests ``*_perf`` output.

    >>> r = parse_nccl_tests('''
    ... #       size    count   type  redop  root   time  algbw  busbw #wrong   time  algbw  busbw #wrong
    ...      1048576   262144  float    sum    -1  40.10  26.15  45.76      0  39.90  26.28  45.99      0
    ... # Out of bounds values : 0 OK
    ... # Avg bus bandwidth    : 45.875
    ... ''')
    >>> r.rows[0].size, r.rows[0].results["in_place"], r.out_of_bounds, r.avg_busbw_gbps
    (1048576, {'time_us': 39.9, 'algbw_gbps': 26.28, 'busbw_gbps': 45.99, 'wrong': 0}, 0, 45.875)
    """
    report = NcclReport()
    columns: list[str] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            columns = _header(line) or columns
            if m := _OUT_OF_BOUNDS.match(line):
                report.out_of_bounds = int(m.group(1))
            if m := _AVG_BUSBW.match(line):
                report.avg_busbw_gbps = _number(m.group(1))
            continue
        tokens = line.split()
        if columns is None or len(tokens) != len(columns) or not tokens[0].isdigit():
            continue  # not a result row (a warning, a log line of NCCL_DEBUG)
        row = _row(columns, tokens)
        if row is not None:
            report.rows.append(row)
    return report


def _row(columns: list[str], tokens: list[str]) -> NcclRow | None:
    values = dict(zip(columns[:2], tokens[:2], strict=True))
    row = NcclRow(
        size=int(values["size"]),
        count=int(values["count"]) if values["count"].isdigit() else 0,
        type=tokens[columns.index("type")] if "type" in columns else "",
        redop=tokens[columns.index("redop")] if "redop" in columns else "",
    )
    # The timed columns appear twice: out-of-place first, then in-place.
    starts = [i for i, c in enumerate(columns) if c == "time"]
    for direction, start in zip(("out_of_place", "in_place"), starts, strict=False):
        group = columns[start : start + 4]
        if tuple(group[:3]) != _TIMED or len(group) < 4:
            return None
        nums = [_number(t) for t in tokens[start : start + 3]]
        if any(n is None for n in nums):
            return None
        entry: dict[str, Any] = {"time_us": nums[0], "algbw_gbps": nums[1], "busbw_gbps": nums[2]}
        check = tokens[start + 3]
        if group[3] == "#wrong":
            entry["wrong"] = int(check) if check.isdigit() else None  # "N/A": validation off
        else:
            entry["error"] = _number(check)
        row.results[direction] = entry
    return row


@register("nccl-tests", "NVIDIA nccl-tests' all_reduce_perf across the GPUs, when installed")
def run(ctx: DiagContext, result: DiagResult) -> None:
    cfg: NcclTestsConfig = ctx.section("nccl-tests")
    result.thresholds = {
        "wrong_elements": 0,
        "out_of_bounds": 0,
        "expected_busbw_gbps": cfg.expected_busbw_gbps,
        "min_fraction": cfg.min_fraction,
    }
    env = ctx.environ
    binary = shutil.which(cfg.binary, path=env.get("PATH"))
    if binary is None:
        raise Skipped(f"{cfg.binary} not installed (not on PATH): nccl-tests not run")
    gpus = cfg.gpus or gpu_count(ctx.nvml)
    if gpus < 1:
        raise Skipped("no GPU: nccl-tests needs one")
    argv = [binary, "-b", cfg.min_bytes, "-e", cfg.max_bytes, "-f", str(cfg.factor), "-g", str(gpus)]
    argv += cfg.extra_args
    result.measured["command"] = argv
    ctx.progress(f"nccl-tests: {' '.join(argv)} (up to {cfg.timeout_s:g} s)")
    run_ = run_tool(argv, cfg.timeout_s, env)
    if run_.timed_out:
        result.fail(f"{' '.join(argv)} did not finish within {cfg.timeout_s:g} s (killed)")
        return
    report = parse_nccl_tests(run_.stdout)
    result.measured.update(
        returncode=run_.returncode,
        rows=[r.to_json() for r in report.rows],
        out_of_bounds=report.out_of_bounds,
        avg_busbw_gbps=report.avg_busbw_gbps,
        peak_busbw_gbps=report.peak_busbw_gbps,
    )
    tail = run_.tail
    if run_.returncode != 0:
        result.fail(f"{cfg.binary} exited with {run_.returncode}: {tail or 'no output'}")
    if not report.rows:
        if run_.returncode == 0:
            result.fail(f"{cfg.binary} printed no result rows: {tail or 'no output'}")
        return
    for size, direction, wrong in report.wrong_rows():
        result.fail(f"all_reduce of {size} B ({direction.replace('_', '-')}): {wrong} wrong element(s)")
    if report.out_of_bounds:
        result.fail(f"{report.out_of_bounds} out-of-bounds value(s)")
    peak = report.peak_busbw_gbps
    if cfg.expected_busbw_gbps is not None and peak is not None:
        floor = cfg.expected_busbw_gbps * cfg.min_fraction
        if peak < floor:
            result.fail(
                f"peak bus bandwidth {peak:.1f} GB/s < {floor:.1f} "
                f"({cfg.min_fraction:g} x the expected {cfg.expected_busbw_gbps:g})"
            )
