"""One realistic event of every registered type, for store and bus tests."""

from __future__ import annotations

from trainguard.schemas.base import Event
from trainguard.schemas.control import (
    ActionEvent,
    ActionPhase,
    Command,
    CommandKind,
    DeadLetter,
    Decision,
    Detection,
    JobSpec,
    Targets,
)
from trainguard.schemas.enums import Action, ProcessRole, Severity
from trainguard.schemas.telemetry import (
    CheckAction,
    CheckOutcome,
    DiskUsage,
    GpuSample,
    GpuSampleBatch,
    GpuState,
    Heartbeat,
    HostSample,
    NicSample,
    NicSampleBatch,
    NodeCheck,
    SourceHealth,
)
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.workload import (
    FlightRecorderDump,
    FlightRecorderEntry,
    FlightRecorderGroup,
    Frame,
    LogLine,
    ProcessExit,
    ProcessInfo,
    RankLiveness,
    StackDump,
    ThreadStack,
    TrainingStep,
)

XID_79 = "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def one_of_each(job: str, ts_ms: int) -> list[Event]:
    node = f"{job}-node0"
    return [
        GpuSampleBatch(
            node=node,
            ts_ms=ts_ms,
            job=job,
            gpus=[
                GpuSample(
                    index=0,
                    uuid="GPU-1",
                    temperature_c=61.5,
                    power_w=640.0,
                    throttle_reasons=["sw_power_cap"],
                    ecc_volatile_uncorrected=0,
                    remap_pending=False,
                    pcie_replay_count=3,
                ),
                GpuSample(index=1, state=GpuState.LOST, error="NVML_ERROR_GPU_IS_LOST"),
            ],
        ),
        HostSample(
            node=node,
            ts_ms=ts_ms,
            job=job,
            cpu_util_pct=42.0,
            load1=3.0,
            load5=2.5,
            load15=2.0,
            mem_total_bytes=2**40,
            mem_available_bytes=2**39,
            disks=[DiskUsage("/", 10**12, 4 * 10**11)],
        ),
        NicSampleBatch(
            node=node,
            ts_ms=ts_ms,
            job=job,
            nics=[
                NicSample(
                    name="eth0", operstate="up", carrier=True, carrier_changes=2, rx_bytes=10, tx_bytes=20
                ),
                NicSample(
                    name="mlx5_0/1",
                    kind="ib",
                    operstate="down",
                    counters={"link_downed": 1, "symbol_error": 4},
                ),
            ],
        ),
        Heartbeat(
            node=node,
            component="exporter",
            ts_ms=ts_ms,
            job=job,
            seq=9,
            sources=[SourceHealth("nvml", True, ts_ms), SourceHealth("nic", False, 0, 3, 1.5, "EIO")],
        ),
        TrainingStep(
            job=job,
            rank=3,
            step=100,
            ts_ms=ts_ms,
            node=node,
            loss=2.31,
            grad_norm=0.9,
            step_time_s=1.2,
            tokens=4096,
            tokens_per_s=3400.0,
            mfu=0.41,
        ),
        LogLine(node=node, ts_ms=ts_ms, source="kernel", line=XID_79, seq=1234, job=job),
        ProcessExit(
            node=node,
            ts_ms=ts_ms,
            pid=4242,
            job=job,
            rank=3,
            exit_code=1,
            traceback="Traceback (most recent call last):\nTypeError: boom",
        ),
        RankLiveness(job=job, node=node, ts_ms=ts_ms, ranks=[2, 3], states=["R", "D"], interval_s=2.0, seq=9),
        StackDump(
            job=job,
            node=node,
            rank=3,
            pid=4242,
            capture_id="cap-1",
            ts_ms=ts_ms,
            role=ProcessRole.MAIN,
            threads=[
                ThreadStack(
                    thread_id=1,
                    name="MainThread",
                    frames=[
                        Frame("all_reduce", "torch/distributed/distributed_c10d.py", 2501),
                        Frame("train_step", "train.py", 88),
                    ],
                )
            ],
            process_tree=[
                ProcessInfo(pid=4242, ppid=1, role=ProcessRole.MAIN, cmdline="python train.py"),
                ProcessInfo(pid=4300, ppid=4242, role=ProcessRole.DATALOADER),
            ],
        ),
        FlightRecorderDump(
            job=job,
            node=node,
            rank=3,
            ts_ms=ts_ms,
            capture_id="cap-1",
            pid=4242,
            fr_version="2.10",
            groups=[FlightRecorderGroup(name="0", desc="default_pg", ranks=[0, 1, 2, 3])],
            entries=[
                FlightRecorderEntry(
                    record_id=7,
                    group="0",
                    seq=7,
                    op="gloo:all_reduce",
                    state="scheduled",
                    input_sizes="[[1024]]",
                    output_sizes="[[1024]]",
                    created_ns=ts_ms * 1_000_000,
                    frames=["all_reduce (torch/distributed/distributed_c10d.py:2501)"],
                )
            ],
        ),
        Detection(
            detection_id=f"{job}-det",
            ts_ms=ts_ms,
            job=job,
            kind="xid_79",
            category="xid",
            severity=Severity.CRITICAL,
            action=Action.EVICT,
            node=node,
            evidence={"line": XID_79},
        ),
        Decision(
            decision_id=f"{job}-dec",
            ts_ms=ts_ms,
            job=job,
            action=Action.EVICT,
            targets=Targets(machines=[node], ranks=[0, 1, 2, 3], group_kind="machine"),
            reason="Xid 79",
            detection_ids=[f"{job}-det"],
        ),
        ActionEvent(
            event_id=f"{job}-act",
            decision_id=f"{job}-dec",
            ts_ms=ts_ms,
            job=job,
            step="evict",
            phase=ActionPhase.SUCCEEDED,
            action=Action.EVICT,
            duration_ms=812.0,
        ),
        Command(
            command_id=f"{job}-cmd",
            ts_ms=ts_ms,
            kind=CommandKind.CAPTURE_STACKS,
            node=node,
            job=job,
            args={"rounds": 1},
        ),
        DeadLetter(
            ts_ms=ts_ms, topic="trainguard.telemetry.logs", reason="not JSON", key=job, payload="{oops"
        ),
        JobSpec(
            job=job,
            ts_ms=ts_ms,
            topology=JobTopology(job=job, tp=2, pp=2, dp=1, ranks_per_machine=4, machines=[node]),
            standbys=[f"{job}-standby0"],
        ),
        NodeCheck(
            check_id=f"{job}-check",
            node=node,
            ts_ms=ts_ms,
            origin="slurm-prolog",
            job="4242",
            outcome=CheckOutcome.FAILED,
            action=CheckAction.DRAINED,
            failed_tests=["gemm-digest"],
            reason="trainguard preflight: gemm-digest: cuda:0: digest 1f2e... differs from the majority",
            duration_s=12.5,
            results={"gemm-digest": {"test": "gemm-digest", "passed": False, "findings": ["cuda:0: ..."]}},
        ),
    ]
