"""The PyTorch tests on the CPU, for real: ``gemm-digest`` (reproducible across processes, a wrong
expected digest fails), ``collective`` with gloo among 2 processes (and its crashed/hung ranks),
``memory``'s patterns on a CPU tensor and its skip without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from trainguard.diag import DiagContext, collective, load_diag_config, memory, run_test  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL_GEMM = {"cpu_size": 96, "chain": 4, "repeats": 2}
HAS_CUDA = torch.cuda.is_available()


def _ctx(**sections: Any) -> DiagContext:
    return DiagContext(cfg=load_diag_config("quick", sections, environ={}))


# -- gemm-digest ------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="the CPU path: this machine has a GPU")
def test_gemm_digest_is_the_same_in_two_processes() -> None:
    """Two fresh interpreters (each its own torch, its own RNG state) give the same bits."""
    code = (
        "from trainguard.commands.diag import diag; "
        "diag(['--test', 'gemm-digest', '--json', '--set', 'gemm_digest.cpu_size=96', "
        "'--set', 'gemm_digest.chain=4'])"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        for _ in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out.decode().splitlines()[-1]))
    digests = [r["measured"]["devices"][0]["digest"] for r in results]
    assert all(r["passed"] is True for r in results)
    assert digests[0] == digests[1] and len(digests[0]) == 64
    assert results[0]["measured"]["devices"][0]["recipe"] == results[1]["measured"]["devices"][0]["recipe"]


def test_gemm_digest_against_expected_digests(tmp_path: Path) -> None:
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    first = run_test("gemm-digest", _ctx(gemm_digest=SMALL_GEMM))
    assert first.passed is True, first.findings
    assert torch.are_deterministic_algorithms_enabled() == deterministic_before  # settings restored
    dev = first.measured["devices"][0]
    assert dev["repeats_agree"] and dev["finite"] and dev["tflops"] is not None
    digest = dev["digest"]

    same = run_test("gemm-digest", _ctx(gemm_digest={**SMALL_GEMM, "expected_digest": digest}))
    assert same.passed is True and same.measured["devices"][0]["digest"] == digest

    flipped = digest[:-1] + ("0" if digest[-1] != "0" else "1")
    bad = run_test("gemm-digest", _ctx(gemm_digest={**SMALL_GEMM, "expected_digest": flipped}))
    assert bad.passed is False
    assert any("differs from the expected" in f for f in bad.findings), bad.findings

    # a file of digests by recipe: the matching recipe is checked, another recipe only noted
    by_recipe = tmp_path / "digests.json"
    by_recipe.write_text(json.dumps({dev["recipe"]: flipped}))
    res = run_test("gemm-digest", _ctx(gemm_digest={**SMALL_GEMM, "expected_file": str(by_recipe)}))
    assert res.passed is False and "digests.json's for" in res.findings[0]
    by_recipe.write_text(json.dumps({"some other GPU|...": flipped}))
    res = run_test("gemm-digest", _ctx(gemm_digest={**SMALL_GEMM, "expected_file": str(by_recipe)}))
    assert res.passed is True and "no expected digest" in res.measured["devices"][0]["note"]

    # another seed is another digest (the digest depends on the inputs, not only the sizes)
    other = run_test("gemm-digest", _ctx(gemm_digest={**SMALL_GEMM, "seed": 1}))
    assert other.measured["devices"][0]["digest"] != digest


# -- collective -------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA and torch.cuda.device_count() >= 2, reason="auto picks NCCL here")
def test_collective_gloo_two_processes() -> None:
    res = run_test("collective", _ctx(collective={"cpu_max_mib": 1, "iters": 2, "timeout_s": 120}))
    assert res.passed is True, res.findings
    m = res.measured
    assert (m["backend"], m["world"], m["sizes"]) == ("gloo", 2, [65536, 1 << 20])
    assert m["checks"] == [
        {"op": op, "bytes": size, "ranks": 2, "wrong": 0}
        for size in (65536, 1 << 20)
        for op in ("all_reduce", "all_gather")
    ]
    assert (
        set(m["bandwidth"]) == {"all_reduce", "all_gather"} and m["bandwidth"]["all_reduce"]["busbw_gbps"] > 0
    )


def test_collective_bandwidth_against_the_expected_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slowest rank's bus bandwidth is the node's; under min_fraction x expected fails."""

    def reports(rank: int, busbw: float) -> dict[str, object]:
        bw = {"op": "all_reduce", "bytes": 1 << 20, "time_us": 10.0, "algbw_gbps": busbw, "busbw_gbps": busbw}
        return {"rank": rank, "device": "cpu", "checks": [], "bandwidth": [bw]}

    fake: tuple[list[dict[str, object]], list[str]] = ([reports(0, 100.0), reports(1, 70.0)], [])
    monkeypatch.setattr(collective, "run_ranks", lambda *args: fake)
    cfg = {"backend": "gloo", "expected_busbw_gbps": 100.0}
    res = run_test("collective", _ctx(collective={**cfg, "min_fraction": 0.8}))
    assert res.measured["bandwidth"]["all_reduce"]["rank"] == 1
    assert res.findings == ["all_reduce bus bandwidth 70.0 GB/s < 80.0 (0.8 x the expected 100)"]
    assert run_test("collective", _ctx(collective={**cfg, "min_fraction": 0.7})).passed is True


def test_collective_reports_crashed_and_hung_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        collective,
        "WORKER",
        [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"],
    )
    res = run_test("collective", _ctx(collective={"backend": "gloo", "timeout_s": 30}))
    assert res.findings == ["rank 0 exited with 3: boom", "rank 1 exited with 3: boom"]

    monkeypatch.setattr(collective, "WORKER", [sys.executable, "-c", "import time; time.sleep(60)"])
    res = run_test("collective", _ctx(collective={"backend": "gloo", "timeout_s": 0.5}))
    assert res.findings == [f"rank {r} did not finish within 0.5 s (a hang): killed" for r in (0, 1)]


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a GPU")
def test_collective_with_nccl_and_no_gpu_is_skipped() -> None:
    res = run_test("collective", _ctx(collective={"backend": "nccl"}))
    assert res.passed is None and res.skipped_reason == "backend nccl needs a GPU; this node has none"


# -- memory -----------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a GPU")
def test_memory_is_skipped_without_a_gpu() -> None:
    res = run_test("memory", _ctx())
    assert res.passed is None and res.skipped_reason == "no CUDA device: the memory pattern test needs a GPU"


def test_memory_patterns_on_a_cpu_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    # small chunks, so the generated patterns cross chunk boundaries in a small buffer
    monkeypatch.setattr(memory, "CHUNK_WORDS", 1000)
    buf = torch.empty(2500, dtype=torch.int32)
    pats = memory.patterns(seed=5)
    assert len(pats) == 41 and len({p.name for p in pats}) == 41
    for p in pats:
        memory.write_pattern(torch, buf, p)
        assert int(memory.count_mismatches(torch, buf, p)) == 0, p.name
    walking = next(p for p in pats if p.name == "walking_one_31")
    memory.write_pattern(torch, buf, walking)
    assert int(buf[0]) == -(1 << 31)  # the top bit alone, as an int32 holds it
    # one flipped bit in a generated pattern, one in a fill: each is exactly one wrong word
    for name in ("random", "index_inverted", "0xAAAAAAAA"):
        p = next(p for p in pats if p.name == name)
        memory.write_pattern(torch, buf, p)
        buf[1999] ^= 1 << 7
        assert int(memory.count_mismatches(torch, buf, p)) == 1, name
    # the random pattern is the seed's: regenerated for the check, different for another seed
    rnd = next(p for p in pats if p.kind == "random")
    memory.write_pattern(torch, buf, rnd)
    other = next(p for p in memory.patterns(seed=6) if p.kind == "random")
    assert int(memory.count_mismatches(torch, buf, other)) > 2000
