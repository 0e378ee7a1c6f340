"""Sources through the runner on the fixture root: events, health, isolation of failures."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

from trainguard_demo.nvml_sim import SimulatedNvml

from tests.exporter.conftest import make_cfg
from trainguard.schemas.telemetry import GpuSampleBatch, GpuState, Heartbeat, HostSample, NicSampleBatch
from trainguard.schemas.workload import LogLine, ProcessExit, RankLiveness
from trainguard.streams.exporter.runner import Exporter
from trainguard.streams.exporter.sources.base import SourceContext
from trainguard.streams.exporter.sources.kernel_log import KernelLogSource


def _by_type(events: list, cls: type) -> list:
    return [e for e in events if isinstance(e, cls)]


def test_one_round_of_every_source(root: Path, tmp_path: Path) -> None:
    cfg = make_cfg(root, tmp_path / "state", nvml={"enabled": True})
    ex = Exporter(cfg, lambda e: None, nvml=SimulatedNvml(8), once=True)
    events = ex.run_once()
    ex.stop()
    (gpu,) = _by_type(events, GpuSampleBatch)
    assert len(gpu.gpus) == 8 and all(g.state is GpuState.OK for g in gpu.gpus)
    assert gpu.gpus[0].nvlink_errors == 0 and gpu.gpus[0].ecc_aggregate_corrected == 2
    (hostev,) = _by_type(events, HostSample)
    assert hostev.mem_total_bytes == 24684084 * 1024 and hostev.swap_used_bytes == (2097148 - 1048574) * 1024
    assert hostev.process_count == 10 and [d.mount for d in hostev.disks] == ["/var/log", "/mnt/local ssd"]
    (nics,) = _by_type(events, NicSampleBatch)
    assert [n.name for n in nics.nics] == ["eth0", "eth1", "mlx5_0/1", "mlx5_1/1"]
    # eth1 and mlx5_1/1 are down and this exporter has not seen them up: sampled, not faults
    assert [n.name for n in nics.nics if n.never_up] == ["eth1", "mlx5_1/1"]
    logs = _by_type(events, LogLine)
    assert len(logs) == 18 and all(e.source == "kernel" and e.node == "node-t" for e in logs)
    assert [e.seq for e in logs] == sorted({e.seq for e in logs})
    (hb,) = _by_type(events, Heartbeat)
    health = {s.name: s for s in hb.sources}
    assert set(health) == {"host", "kernel_log", "nic", "nvml", "process", "reporter", "heartbeat"}
    assert all(s.ok for n, s in health.items() if n != "heartbeat")
    assert events[-1] is hb  # heartbeat runs last and reports this round


def test_failing_source_is_reported_and_others_continue(root: Path, tmp_path: Path) -> None:
    shutil.rmtree(root / "sys/class/net")
    (root / "proc/meminfo").write_text("MemTotal: lots\n")  # garbage: parsed as 0, not a crash
    (root / "proc/loadavg").write_text("\x00\x01")  # garbage: this one raises
    cfg = make_cfg(root, tmp_path / "state")
    ex = Exporter(cfg, lambda e: None, once=True)
    events = ex.run_once()
    events += ex.run_once()
    ex.stop()
    hbs = _by_type(events, Heartbeat)
    health = {s.name: s for s in hbs[-1].sources}
    assert (
        not health["nic"].ok
        and health["nic"].error_count == 2
        and "FileNotFoundError" in health["nic"].last_error
    )
    assert not health["host"].ok and "ValueError" in health["host"].last_error
    assert health["kernel_log"].ok and health["process"].ok
    assert _by_type(events, LogLine) and not _by_type(events, NicSampleBatch)


def test_nvml_states_lost_unsupported_missing_and_xid(root: Path, tmp_path: Path) -> None:
    sim = SimulatedNvml(4)
    sim.gpus[1].lost = True
    sim.gpus[2].unsupported = {
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetNvLinkState",
        "nvmlDeviceGetPowerUsage",
    }
    sim.gpus[3].temperature_c, sim.gpus[3].throttle_mask = 93, 0x40
    cfg = make_cfg(root, tmp_path / "s", nvml={"enabled": True, "expect_gpus": 6})
    ex = Exporter(cfg, lambda e: None, nvml=sim, once=True)
    sim.xid(3, 79)
    events = ex.run_source("nvml")
    (batch,) = _by_type(events, GpuSampleBatch)
    states = [g.state for g in batch.gpus]
    assert states == [
        GpuState.OK,
        GpuState.LOST,
        GpuState.OK,
        GpuState.OK,
        GpuState.UNAVAILABLE,
        GpuState.UNAVAILABLE,
    ]
    assert "lost" in batch.gpus[1].error.lower()
    g2 = batch.gpus[2]
    assert (g2.remap_pending, g2.nvlink_errors, g2.power_w) == (None, None, None) and g2.temperature_c == 62.0
    assert batch.gpus[3].throttle_reasons == ["hw_thermal_slowdown"]
    (xid,) = _by_type(events, LogLine)
    assert xid.source == "nvml" and xid.line.startswith("NVRM: Xid (PCI:0000:48:00): 79,")
    assert _by_type(ex.run_source("nvml"), LogLine) == []  # drained
    ex.stop()
    assert sim.inited == 0  # shut down on stop


def test_nvml_without_driver_is_a_state(root: Path, tmp_path: Path) -> None:
    cfg = make_cfg(root, tmp_path / "s", nvml={"enabled": True, "expect_gpus": 2})
    ex = Exporter(cfg, lambda e: None, nvml=SimulatedNvml(2, driver_loaded=False), once=True)
    (batch,) = ex.run_source("nvml")
    assert isinstance(batch, GpuSampleBatch)
    assert [g.state for g in batch.gpus] == [GpuState.NO_DRIVER] * 2 and "Driver Not Loaded" in batch.gpus[
        0
    ].error
    ex.stop()


def test_nvml_real_pynvml_without_library(root: Path, tmp_path: Path) -> None:
    # No GPU, no libnvidia-ml on this machine: the real pynvml path must report it, not crash.
    cfg = make_cfg(root, tmp_path / "s", nvml={"enabled": True})
    ex = Exporter(cfg, lambda e: None, once=True)
    (batch,) = ex.run_source("nvml")
    assert isinstance(batch, GpuSampleBatch) and batch.gpus[0].state is GpuState.NO_DRIVER
    ex.stop()


def test_process_exits_reported_once(root: Path, tmp_path: Path) -> None:
    cfg = make_cfg(root, tmp_path / "s")
    ex = Exporter(cfg, lambda e: None, once=True)
    first = _by_type(ex.run_source("process"), ProcessExit)
    assert [(e.pid, e.exit_code, e.signal, e.rank) for e in first] == [(104, 139, None, 0)]  # the zombie
    shutil.rmtree(root / "proc/104")  # reaped
    shutil.rmtree(root / "proc/202")  # rank 1's dataloader worker vanished
    second = _by_type(ex.run_source("process"), ProcessExit)
    assert [(e.pid, e.role.value, e.rank, e.exit_code) for e in second] == [(202, "dataloader", 1, None)]
    assert "not visible" in second[0].reason
    assert _by_type(ex.run_source("process"), ProcessExit) == []
    ex.stop()


def _kernel_source(root: Path, state: Path, **kw: object) -> KernelLogSource:
    cfg = make_cfg(root, state, kernel_log=kw)
    state.mkdir(parents=True, exist_ok=True)
    return KernelLogSource(SourceContext(cfg, state_dir=state))


def _lines(src: KernelLogSource) -> list[LogLine]:
    out = [e for e in src.collect() if isinstance(e, LogLine)]
    src.commit()
    return out


XID = "[ 9000.000001] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.\n"


def test_kernel_log_restart_rotation_truncation_partial_lines(root: Path, tmp_path: Path) -> None:
    log_path = root / "var/log/kern.log"
    state = tmp_path / "state"
    src = _kernel_source(root, state)
    first = _lines(src)
    assert len(first) == 18
    # a line being written (no newline yet) is not published until it is complete
    with open(log_path, "a") as fh:
        fh.write(XID[:30])
    assert _lines(src) == []
    with open(log_path, "a") as fh:
        fh.write(XID[30:])
    (xid,) = _lines(src)
    assert xid.line == XID.strip() and xid.seq == first[-1].seq + 1  # the last fixture line was the panic
    src.close()
    # restart: nothing re-sent, new lines picked up
    src = _kernel_source(root, state)
    assert _lines(src) == []
    with open(log_path, "a") as fh:
        fh.write(XID.replace("79", "48"))
    (again,) = _lines(src)
    assert ": 48," in again.line and again.seq > xid.seq
    # rotation while running: the old file's tail is read before switching
    with open(log_path, "a") as fh:
        fh.write(XID.replace("79", "31"))
    os.rename(log_path, log_path.with_name("kern.log.1"))
    log_path.write_text(XID.replace("79", "13"))
    rotated = _lines(src)
    assert [line.line.split(": ")[2].split(",")[0] for line in rotated] == ["31", "13"]
    # rotation while stopped: the rotated file's rest is read first
    src.close()
    with open(log_path, "a") as fh:
        fh.write(XID.replace("79", "94"))
    os.rename(log_path, log_path.with_name("kern.log.2"))
    log_path.write_text(XID.replace("79", "95"))
    src = _kernel_source(root, state)
    assert [line.line.split(": ")[2].split(",")[0] for line in _lines(src)] == ["94", "95"]
    # copytruncate
    log_path.write_text("")
    assert _lines(src) == []
    log_path.write_text(XID.replace("79", "63"))
    (trunc,) = _lines(src)
    assert ": 63," in trunc.line
    seqs = [e.seq for e in first] + [xid.seq, again.seq] + [e.seq for e in rotated] + [trunc.seq]
    assert seqs == sorted(set(seqs))  # monotonic across restarts and rotations: a dedup key
    src.close()


def test_kernel_log_start_at_end_and_all_lines(root: Path, tmp_path: Path) -> None:
    src = _kernel_source(root, tmp_path / "a", start_at="end")
    assert _lines(src) == []
    src.close()
    src = _kernel_source(root, tmp_path / "b", all_lines=True)
    assert len(_lines(src)) == 24  # every non-empty line, the garbage one included
    src.close()


def test_kernel_log_real_kmsg(root: Path, tmp_path: Path) -> None:
    # The machine's own /dev/kmsg: records parse, and a second read returns only newer ones.
    cfg = make_cfg(root, tmp_path / "s", kernel_log={"path": "/dev/kmsg", "all_lines": True})
    (tmp_path / "s").mkdir()
    src = KernelLogSource(SourceContext(cfg, state_dir=tmp_path / "s"))
    first = _lines(src)
    assert first and all(e.line.startswith("[") for e in first)
    seqs = [e.seq for e in first]
    assert seqs == sorted(seqs)
    src.close()
    src = KernelLogSource(SourceContext(cfg, state_dir=tmp_path / "s"))
    assert all(e.seq > seqs[-1] for e in _lines(src))  # resumed after the saved sequence number
    src.close()


def test_kernel_log_ships_every_line_a_rule_matches(root: Path, tmp_path: Path) -> None:
    """NIC lines have rules (a link down, a transmit timeout, a crashed mlx5) but no kernel-log
    category: the prefilter comes from the rule table, so they reach the workers; noise does not."""
    log_path = tmp_path / "kern.log"
    wanted = [
        "[ 5521.118340] mlx5_core 0000:5e:00.0 ib0: Link down",
        "[ 5522.000001] NETDEV WATCHDOG: eth0 (ixgbe): transmit queue 3 timed out 5120 ms",
        "[ 5523.000001] mlx5_core 0000:5e:00.0: poll_health:815:(pid 0): device's health compromised",
    ]
    log_path.write_text("\n".join([*wanted, "[ 5524.0] usb 1-1: new high-speed USB device number 2", ""]))
    src = _kernel_source(root, tmp_path / "s", path=str(log_path))
    assert [e.line for e in _lines(src)] == wanted
    src.close()


def test_process_liveness_names_the_live_ranks_every_round(root: Path, tmp_path: Path) -> None:
    cfg = make_cfg(root, tmp_path / "s")
    ex = Exporter(cfg, lambda e: None, once=True)
    (first,) = _by_type(ex.run_source("process"), RankLiveness)
    assert (first.job, first.node, first.ranks, first.seq) == ("job-t", "node-t", [0, 1], 1)
    assert first.states == ["S", "R"] and first.interval_s == cfg.process.interval_s
    # Rank 0's main process dies (a zombie until reaped): only rank 1 lives here now.
    stat = root / "proc/101/stat"
    stat.write_text(stat.read_text().replace(") S ", ") Z ", 1))
    (second,) = _by_type(ex.run_source("process"), RankLiveness)
    assert (second.ranks, second.seq) == ([1], 2)
    ex.stop()


def test_no_liveness_without_a_job(root: Path, tmp_path: Path) -> None:
    cfg = replace(make_cfg(root, tmp_path / "s"), job="")
    ex = Exporter(cfg, lambda e: None, once=True)
    assert _by_type(ex.run_source("process"), RankLiveness) == []
    ex.stop()


def test_liveness_is_sent_with_no_rank_too(root: Path, tmp_path: Path) -> None:
    for pid in ("101", "102", "103", "104", "201", "202"):
        shutil.rmtree(root / "proc" / pid)
    ex = Exporter(make_cfg(root, tmp_path / "s"), lambda e: None, once=True)
    (live,) = _by_type(ex.run_source("process"), RankLiveness)
    assert (live.ranks, live.states) == ([], [])
    ex.stop()
