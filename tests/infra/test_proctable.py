"""The one process-table reader: a fixture procfs tree and this host's live ``/proc``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.waiting import wait_until
from trainguard.infra.proctable import LIVE, ProcTable

FIXTURE_PROC = Path(__file__).parents[1] / "exporter" / "fixtures" / "root" / "proc"


def test_fixture_tree() -> None:
    table = ProcTable(FIXTURE_PROC)
    stats = table.stats()
    assert 999 not in stats and 101 in stats  # a garbled stat line is skipped, not an error
    assert table.stat(999) is None and table.stat(4_000_000) is None
    assert stats[201].comm == "python3 (rank 1)" and stats[201].ppid == 100
    assert table.alive(101) and not table.alive(104)  # 104 is a zombie
    assert stats[104].exit_status is not None
    assert table.ppid(101) == 100 and table.ppid(4_000_000) == 0
    assert table.argv(101) == ["/usr/bin/python3", "-u", "train.py", "--config", "llama.yaml"]
    assert table.cmdline(101) == "/usr/bin/python3 -u train.py --config llama.yaml"
    assert table.argv(300) == ["sshd: /usr/sbin/sshd -D"]  # a renamed process: one title
    assert table.argv(104) == [] and table.cmdline(4_000_000) == ""
    env = table.environ(101)
    assert env is not None and env["RANK"] == "0"
    assert table.environ(4_000_000) is None
    assert table.exists(101) and not table.exists(4_000_000) and not table.exists(0)
    assert ProcTable(FIXTURE_PROC / "nope").pids() == []


def test_live_table_sees_zombies_and_reaped_children() -> None:
    me = os.getpid()
    assert LIVE.alive(me) and LIVE.ppid(me) == os.getppid()
    assert LIVE.argv(me)[0] and LIVE.environ(me) is not None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert LIVE.alive(child.pid) and LIVE.ppid(child.pid) == me
        assert child.pid in LIVE.pids()
        child.kill()
        wait_until(lambda: not LIVE.alive(child.pid), 10, f"killed child {child.pid} to die", interval_s=0.02)
        st = LIVE.stat(child.pid)  # not reaped yet: a zombie, which is not alive
        assert st is not None and st.state == "Z" and not st.alive and LIVE.exists(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not LIVE.alive(child.pid) and LIVE.stat(child.pid) is None


_HANDLES_TERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], 'w').write('bye'), sys.exit(0)))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)
_BLOCKS_TERM = (
    "import signal, time\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_takes_default_reads_the_signal_masks(tmp_path: Path) -> None:
    """Default SIGTERM (a plain sleeper), caught (a handler), blocked (a mask), gone."""
    procs = {
        "default": subprocess.Popen(
            [sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(60)"],
            stdout=subprocess.PIPE,
        ),
        "caught": subprocess.Popen(
            [sys.executable, "-c", _HANDLES_TERM, str(tmp_path / "bye")], stdout=subprocess.PIPE
        ),
        "blocked": subprocess.Popen([sys.executable, "-c", _BLOCKS_TERM], stdout=subprocess.PIPE),
    }
    try:
        for p in procs.values():
            assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        term = 15
        assert LIVE.takes_default(procs["default"].pid, term)
        assert not LIVE.takes_default(procs["caught"].pid, term)
        assert not LIVE.takes_default(procs["blocked"].pid, term)
        assert LIVE.takes_default(procs["caught"].pid, 10)  # SIGUSR1: no handler there
        assert not LIVE.takes_default(4_000_000, term)  # gone: nothing to say
        assert not ProcTable(FIXTURE_PROC).takes_default(101, term)  # no status file in the fixture
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
