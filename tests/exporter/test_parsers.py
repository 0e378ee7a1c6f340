"""Pure parsers on real-format fixtures (sysfs, procfs, kernel log, kmsg, py-spy JSON, NVML)."""

from __future__ import annotations

import doctest
import importlib
import json
from pathlib import Path

import pytest

from tests.exporter.conftest import FIXTURES
from trainguard.detectors.rule_table import default_rule_table
from trainguard.infra.proctable import ProcTable
from trainguard.schemas.enums import ProcessRole
from trainguard.streams.exporter.config import HostConfig, NicConfig
from trainguard.streams.exporter.sources import host, kernel_log, nic, process
from trainguard.streams.exporter.sources.nvml import build_gpu_sample, decode_throttle, xid_line
from trainguard.streams.exporter.stack_capture import parse_pyspy_json, refine_role, render_text

ROOT = FIXTURES / "root"
LOG_RULE_EXAMPLES = [
    (r.id, i, ex)
    for r in default_rule_table().rules
    if r.source == "log" and r.context != "traceback"  # a Python traceback's last line: not a kernel line
    for i, ex in enumerate(r.examples)
]

MODULES = [
    "trainguard.streams.exporter.sources.host",
    "trainguard.streams.exporter.sources.kernel_log",
    "trainguard.streams.exporter.sources.nic",
    "trainguard.streams.exporter.sources.nvml",
    "trainguard.streams.exporter.sources.process",
    "trainguard.streams.exporter.stack_capture",
    "trainguard.streams.exporter.spool",
    "trainguard.streams.exporter.commands",
    "trainguard.streams.reporter",
]


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module: str) -> None:
    # pytest's --doctest-modules does not cover streams/ (testpaths); run them here.
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0


def test_nic_scan_ethernet_and_infiniband() -> None:
    result = nic.scan(ROOT / "sys/class")
    nics = {n.name: n for n in result.samples}
    assert sorted(nics) == ["eth0", "eth1", "mlx5_0/1", "mlx5_1/1"]
    eth0 = nics["eth0"]
    assert (eth0.operstate, eth0.carrier, eth0.carrier_changes) == ("up", True, 2)
    assert (eth0.rx_bytes, eth0.tx_bytes, eth0.rx_errors, eth0.rx_dropped) == (
        981273645123,
        1234987654,
        3,
        17,
    )
    eth1 = nics["eth1"]
    # down: no readable carrier, a garbage counter becomes None rather than an error
    assert (eth1.operstate, eth1.carrier, eth1.carrier_changes, eth1.tx_errors) == ("down", None, 7, None)
    ib = nics["mlx5_0/1"]
    assert (ib.kind, ib.operstate, ib.carrier) == ("ib", "active", True)
    assert ib.counters["link_downed"] == 1 and ib.counters["port_rcv_errors"] == 12
    assert ib.rx_bytes == 250000000 * 4  # IB data counters are in 4-byte words
    assert (nics["mlx5_1/1"].operstate, nics["mlx5_1/1"].carrier) == ("down", False)
    # the scan marks nothing: never_up is the source's (it needs to remember past rounds)
    assert not any(n.never_up for n in result.samples)


def test_nic_default_skips_loopback_by_its_type() -> None:
    sel = nic.Selection.from_config(NicConfig(infiniband=False), environ={})
    result = nic.scan(ROOT / "sys/class", sel)
    assert [n.name for n in result.samples] == ["eth0", "eth1"]
    assert result.skipped == [
        ("lo", "virtual: loopback"),
        ("mlx5_0/1", "nic.infiniband: false"),
        ("mlx5_1/1", "nic.infiniband: false"),
    ]


def test_host_parsers_on_fixture_proc() -> None:
    cpu = host.parse_proc_stat((ROOT / "proc/stat").read_text())
    assert cpu.total == 163824 + 36828 + 180372 + 1740 + 601 + 426
    assert cpu.busy == cpu.total - 180372 - 1740
    mem = host.parse_meminfo((ROOT / "proc/meminfo").read_text())
    assert mem["MemAvailable"] == 23750264 * 1024 and mem["HugePages_Total"] == 0
    assert host.parse_loadavg((ROOT / "proc/loadavg").read_text()) == (20.46, 2.61, 3.64)
    mounts = host.parse_mounts((ROOT / "proc/mounts").read_text(), set(HostConfig().skip_fs_types))
    assert mounts == ["/var/log", "/mnt/local ssd"]
    with pytest.raises(ValueError):
        host.parse_proc_stat("intr 1 2 3\n")


KERNEL_EXPECTED = {
    "xid": 3,
    "nvrm": 1,
    "oom": 3,
    "io_error": 3,
    "fs_error": 4,
    "panic": 4,
}


def test_kernel_line_classification_on_fixture_log() -> None:
    raw = (ROOT / "var/log/kern.log").read_bytes().decode("utf-8", "replace").splitlines()
    counts: dict[str, int] = {}
    for line in raw:
        cat = kernel_log.classify_kernel_line(line)
        if cat:
            counts[cat] = counts.get(cat, 0) + 1
    assert counts == KERNEL_EXPECTED
    noise = [line for line in raw if kernel_log.classify_kernel_line(line) is None]
    assert any("usb 1-1" in line for line in noise) and any("garbage" in line for line in noise)


def test_kmsg_records_fixture() -> None:
    records = json.loads((FIXTURES / "kmsg_records.json").read_text())
    parsed = [kernel_log.parse_kmsg_record(r) for r in records]
    good = [p for p in parsed if p is not None]
    assert [p.seq for p in good] == [0, 1523, 1524, 1525, 1526]
    xid = good[1]
    assert xid.level == 4 and xid.message.startswith("NVRM: Xid (PCI:0000:3b:00): 79")
    assert "SUBSYSTEM" not in xid.message
    assert xid.as_dmesg().startswith("[ 8123.456789] NVRM: Xid")
    assert good[3].level == 4  # facility bits (12 = user.warning) stripped from the priority
    assert [kernel_log.classify_kernel_line(p.message) for p in good] == [None, "xid", "oom", None, "panic"]


def test_process_tree_roles_ranks_and_zombie() -> None:
    cfg = process.ProcessConfig(cmd_pattern="train.py")
    procs = {p.pid: p for p in process.discover(cfg, ROOT / "proc", ROOT / "sys/fs/cgroup")}
    assert sorted(procs) == [100, 101, 102, 103, 104, 201, 202]  # sshd/systemd/garbage 999 left out
    roles = {pid: (p.role.value, p.rank) for pid, p in procs.items()}
    assert roles == {
        100: ("other", -1),  # torchrun agent: no RANK
        101: ("main", 0),
        102: ("dataloader", 0),
        103: ("checkpoint", 0),
        104: ("other", 0),
        201: ("main", 1),
        202: ("dataloader", 1),
    }
    assert procs[201].comm == "python3 (rank 1)"
    assert procs[104].state == "Z" and procs[104].exit_status is not None
    assert process.decode_wait_status(procs[104].exit_status) == (139, None)
    assert procs[102].ppid == 101 and procs[101].role is ProcessRole.MAIN  # the worker's rank's main


def test_process_selection_by_pid_and_cgroup(tmp_path: Path) -> None:
    table = ProcTable(ROOT / "proc")
    stats = table.stats()
    assert 999 not in stats  # garbled stat line skipped
    cg = tmp_path / "kubepods/pod1"
    cg.mkdir(parents=True)
    (cg / "cgroup.procs").write_text("201\n202\n4000000\n")
    cfg = process.ProcessConfig(pids=[101, 555], cgroup="kubepods/pod1")
    assert process.select_pids(cfg, table, tmp_path, stats) == {101, 201, 202}
    tree = process.build_tree(cfg, table, stats, {101, 201, 202})
    assert sorted(p.pid for p in tree) == [101, 102, 103, 104, 201, 202]


def test_pyspy_json_real_dump() -> None:
    text = (FIXTURES / "pyspy/sleeper.json").read_text()
    by_pid = parse_pyspy_json(text)
    (pid,) = by_pid
    threads = by_pid[pid]
    assert [t.name for t in threads] == ["QueueFeederThread", "MainThread"]
    main = threads[1]
    assert [f.function for f in main.frames] == ["train_step", "<module>"]
    assert main.frames[0].filename == "/tmp/sleeper.py" and main.frames[0].line == 8
    assert threads[0].frames[0].function == "Condition.wait"
    out = render_text(pid, threads)
    assert "Thread 0x" in out and "train_step (/tmp/sleeper.py:8)" in out
    assert refine_role(ProcessRole.OTHER, threads) is ProcessRole.OTHER
    with pytest.raises(ValueError):
        parse_pyspy_json('{"not": "a list"}')


def test_nvml_sample_building() -> None:
    raw = {
        "uuid": "GPU-1",
        "util_gpu": 100,
        "util_mem": 37,
        "mem_used": 1,
        "mem_total": 2,
        "temperature_c": 91,
        "power_mw": 700_000,
        "throttle_mask": 0x20 | 0x40 | 0x4,
        "ecc_volatile_uncorrected": 3,
        "remapped_rows_uncorrectable": 1,
        "remap_failure": True,
        "pcie_replay_count": 12,
        "nvlink_errors": 5,
    }
    s = build_gpu_sample(3, raw)
    assert (s.index, s.temperature_c, s.power_w, s.util_gpu_pct) == (3, 91.0, 700.0, 100.0)
    assert s.throttle_reasons == ["sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown"]
    assert (s.ecc_volatile_uncorrected, s.remap_failure, s.pcie_replay_count, s.nvlink_errors) == (
        3,
        True,
        12,
        5,
    )
    assert s.sm_clock_mhz is None and s.ecc_aggregate_corrected is None  # unsupported stays None
    assert decode_throttle(0) == []
    assert kernel_log.classify_kernel_line(xid_line("00000000:3B:00.0", 79)) == "xid"


@pytest.mark.parametrize(("rule_id", "n", "line"), LOG_RULE_EXAMPLES)
def test_every_log_rule_example_passes_the_exporter_prefilter(rule_id: str, n: int, line: str) -> None:
    """A row whose lines the exporter drops never fires in production: every example of every
    log row of the built-in table is shipped by the kernel-log source."""
    assert kernel_log.shipped(line, default_rule_table()), f"{rule_id} example {n} would not be shipped"
