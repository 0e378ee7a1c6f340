"""The training guide's script (docs/training-api.md) runs as written under torchrun.

The guide's first Python block (the whole script) is extracted and run with 2 ranks (gloo, CPU); a Unix datagram socket
stands where the node exporter's would be, and every rank's steps and its exit must arrive there,
encoded as the exporter decodes them.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from trainguard.schemas.codec import decode
from trainguard.schemas.workload import ProcessExit, TrainingStep

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "training-api.md"


def guide_script() -> str:
    # The first Python block is the script; later blocks (checkpoints) are fragments of it.
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.S)
    assert blocks, "the guide has no Python block"
    return str(blocks[0])


def test_the_guide_marks_its_lines() -> None:
    marked = [
        line
        for line in guide_script().splitlines()
        if line.rstrip().endswith("# trainguard") or "# trainguard:" in line
    ]
    assert len(marked) == 4
    script = guide_script()
    # Rule 1: the Reporter comes before the process group.
    assert script.index("Reporter()") < script.index("init_process_group")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_guide_script_reports_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(guide_script())
    sock_path = tmp_path / "reporter.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.5)
    received: list[bytes] = []
    done = threading.Event()

    def collect() -> None:
        while not done.is_set():
            try:
                received.append(sock.recv(1 << 16))
            except TimeoutError:
                continue

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    env = {
        **os.environ,
        "TRAINGUARD_JOB": "guide-job",
        "TRAINGUARD_NODE": "n0",
        "TRAINGUARD_REPORTER_SOCKET": str(sock_path),
        "OMP_NUM_THREADS": "1",
    }
    try:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(script),
                "--steps",
                "5",
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=200,
        )
    finally:
        done.set()
        collector.join(5)
        sock.close()
    assert run.returncode == 0, run.stderr[-3000:]
    events = [decode(line) for datagram in received for line in datagram.splitlines() if line.strip()]
    steps = sorted((e.rank, e.step) for e in events if isinstance(e, TrainingStep))
    assert steps == [(r, s) for r in (0, 1) for s in range(1, 6)]
    assert all(e.job == "guide-job" and e.node == "n0" for e in events if isinstance(e, TrainingStep))
    exits = sorted((e.rank, e.exit_code) for e in events if isinstance(e, ProcessExit))
    assert exits == [(0, 0), (1, 0)]
