"""Real-time inspection of machine telemetry: GPU, NIC and host samples and kernel-log lines.

ByteRobust §4.1 step ①: high-confidence, machine-specific events (GPU lost, uncorrectable ECC,
Xid 79) recommend eviction of that machine; network alerts are tolerated until they repeat (the
rule table's count/window); everything else is recorded with its recommendation.  One
:class:`NodeInspector` per worker holds the rule classifier (with its windows) and the previous
counter values needed for growth rules (PCIe replays, ECC, carrier changes).

>>> from trainguard.schemas.telemetry import GpuSample, GpuSampleBatch, GpuState
>>> ins = NodeInspector()
>>> batch = GpuSampleBatch(node="n7", ts_ms=1000, job="j", gpus=[GpuSample(index=3, state=GpuState.LOST)])
>>> [(d.kind, d.action.value, d.node) for d in ins.inspect(batch, now_ms=1001)]
[('nvml-gpu-lost', 'evict', 'n7')]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.detectors.detections import detection_from_finding
from trainguard.detectors.findings import Finding
from trainguard.detectors.log_classifier import Classification, ClassifierConfig, LogClassifier
from trainguard.detectors.rule_table import RuleTable
from trainguard.schemas.base import Event
from trainguard.schemas.control import Detection
from trainguard.schemas.enums import Action, Severity
from trainguard.schemas.telemetry import GpuSampleBatch, HostSample, NicSampleBatch
from trainguard.schemas.typecheck import bounds
from trainguard.schemas.workload import NODE_LOG_SOURCES, LogLine


@dataclass(frozen=True)
class HostThresholds:
    """Host inspection thresholds (ByteRobust: CPU overload, disk full are explicit failures)."""

    cpu_overload_pct: float = field(default=98.0, metadata=bounds(1, 100))
    disk_full_pct: float = field(default=97.0, metadata=bounds(1, 100))
    mem_available_min_pct: float = field(default=2.0, metadata=bounds(0, 100))
    #: what sustained CPU overload recommends; "ignore" records it only (shared or simulated hosts).
    cpu_overload_action: Action = Action.DIAGNOSE
    #: overload must last this long (every sample at or above ``cpu_overload_pct``) before it
    #: recommends ``cpu_overload_action``: one busy sample is a compile or a checkpoint, not a
    #: reason to stop a job.  Shorter overload is recorded (``ignore``).
    cpu_overload_sustain_s: float = field(default=120.0, metadata=bounds(0, 86_400))


class NodeInspector:
    """Machine telemetry -> detections, through the rule table."""

    def __init__(
        self,
        table: RuleTable | None = None,
        config: ClassifierConfig | None = None,
        host: HostThresholds | None = None,
    ) -> None:
        self.classifier = LogClassifier(table, config)
        self.host = host or HostThresholds()
        # node -> gpu -> last counters; node -> nic -> last carrier_changes.
        self._gpu_prev: dict[str, dict[int, dict[str, int | None]]] = {}
        self._nic_prev: dict[str, dict[str, int | None]] = {}
        #: node -> time (s) of the first sample of its current CPU overload.
        self._overload_since: dict[str, float] = {}
        #: nodes whose state (counters, rule windows) changed since :meth:`take_dirty`.
        self._dirty: set[str] = set()

    def inspect(self, event: Event, now_ms: int) -> list[Detection]:
        if isinstance(event, GpuSampleBatch):
            return self._gpu(event, now_ms)
        if isinstance(event, NicSampleBatch):
            return self._nic(event, now_ms)
        if isinstance(event, HostSample):
            return self._host(event, now_ms)
        if isinstance(event, LogLine):
            return self._log(event, now_ms)
        return []

    def _emit(
        self,
        c: Classification,
        e: GpuSampleBatch | NicSampleBatch | HostSample | LogLine,
        now_ms: int,
        key: object,
    ) -> list[Detection]:
        if c.action is Action.NONE:
            return []
        finding = c.to_finding(job=e.job or None, node=e.node)
        if finding is None:
            return []
        return [
            detection_from_finding(
                finding, job=e.job, node=e.node, source_ts_ms=e.ts_ms, now_ms=now_ms, source_key=key
            )
        ]

    def _gpu(self, e: GpuSampleBatch, now_ms: int) -> list[Detection]:
        out = []
        for g in e.gpus:
            node_prev = self._gpu_prev.setdefault(e.node, {})
            prev = node_prev.get(g.index, {})
            sample = {
                "gpu": g.index,
                "state": g.state.value,
                "ecc_volatile_uncorrected": g.ecc_volatile_uncorrected,
                "ecc_volatile_uncorrected_prev": prev.get("ecc"),
                "remap_failure": g.remap_failure,
                "remap_pending": g.remap_pending,
                "temperature_c": g.temperature_c,
                "throttle_reasons": list(g.throttle_reasons),
                "pcie_replay_count": g.pcie_replay_count,
                "pcie_replay_count_prev": prev.get("pcie"),
            }
            # First sight of a GPU: take its counters as the baseline (a counter accumulated over
            # weeks of uptime is not news), except uncorrectable ECC which is never benign.
            if not prev:
                sample.pop("pcie_replay_count_prev")
            sample = {k: v for k, v in sample.items() if v is not None}
            now_prev = {"ecc": g.ecc_volatile_uncorrected, "pcie": g.pcie_replay_count}
            if now_prev != prev:
                node_prev[g.index] = now_prev
                self._dirty.add(e.node)
            for c in self.classifier.classify_nvml(sample, ts=e.ts_ms / 1000, host=e.node):
                out += self._emit(c, e, now_ms, ("gpu", g.index))
        return out

    def _nic(self, e: NicSampleBatch, now_ms: int) -> list[Detection]:
        out = []
        for n in e.nics:
            node_prev = self._nic_prev.setdefault(e.node, {})
            prev = node_prev.get(n.name)
            if n.name not in node_prev or prev != n.carrier_changes:
                node_prev[n.name] = n.carrier_changes
                self._dirty.add(e.node)
            sample = {
                "interface": n.name,
                "operstate": n.operstate,
                "carrier": None if n.carrier is None else int(n.carrier),
                "carrier_changes": n.carrier_changes,
                "carrier_changes_prev": prev,
                # Not seen up by its exporter yet: down is its resting state, not a fault.
                "never_up": int(n.never_up),
            }
            if n.kind == "ib":
                sample["port_state"] = n.operstate
            sample = {k: v for k, v in sample.items() if v is not None}
            for c in self.classifier.classify_nic(sample, ts=e.ts_ms / 1000, host=e.node):
                out += self._emit(c, e, now_ms, ("nic", n.name))
        return out

    def _host(self, e: HostSample, now_ms: int) -> list[Detection]:
        findings: list[tuple[str, Severity, Action, dict[str, Any]]] = []
        ts = e.ts_ms / 1000
        if e.cpu_util_pct >= self.host.cpu_overload_pct:
            if e.node not in self._overload_since:
                self._overload_since[e.node] = ts
                self._dirty.add(e.node)
            sustained = max(0.0, ts - self._overload_since[e.node])
            act = (
                self.host.cpu_overload_action
                if sustained >= self.host.cpu_overload_sustain_s
                else Action.IGNORE
            )
            findings.append(
                (
                    "cpu_overload",
                    Severity.WARNING,
                    act,
                    {"cpu_util_pct": e.cpu_util_pct, "sustained_s": round(sustained, 1)},
                )
            )
        elif self._overload_since.pop(e.node, None) is not None:
            self._dirty.add(e.node)
        for d in e.disks:
            if d.total_bytes and 100.0 * d.used_bytes / d.total_bytes >= self.host.disk_full_pct:
                pct = round(100.0 * d.used_bytes / d.total_bytes, 1)
                findings.append(
                    ("disk_full", Severity.ERROR, Action.DIAGNOSE, {"mount": d.mount, "used_pct": pct})
                )
        if (
            e.mem_total_bytes
            and 100.0 * e.mem_available_bytes / e.mem_total_bytes < self.host.mem_available_min_pct
        ):
            findings.append(
                (
                    "cpu_oom_risk",
                    Severity.WARNING,
                    Action.IGNORE,
                    {"mem_available_bytes": e.mem_available_bytes},
                )
            )
        return [
            detection_from_finding(
                Finding(kind=f"host-{cat}", category=cat, severity=sev, action=act, node=e.node, evidence=ev),
                job=e.job,
                node=e.node,
                source_ts_ms=e.ts_ms,
                now_ms=now_ms,
                source_key=cat,
            )
            for cat, sev, act, ev in findings
        ]

    def _log(self, e: LogLine, now_ms: int) -> list[Detection]:
        # Each (node, source) is its own stream for traceback tracking.  Only the node's own
        # kernel and NVML lines may fire the kernel/driver rows: a rank that prints an Xid line
        # (or forges one naming another machine) is read as that process's output.
        from_node = e.source in NODE_LOG_SOURCES
        c = self.classifier.feed(e.line, ts=e.ts_ms / 1000, host=f"{e.node}/{e.source}", from_node=from_node)
        if c.matched and e.rank >= 0 and "rank" not in c.fields:
            c = Classification(**{**c.__dict__, "fields": {**c.fields, "rank": e.rank}})
        return self._emit(c, e, now_ms, ("log", e.source, e.seq))

    # -- state kept across worker restarts (see :mod:`trainguard.detectors.keyed_state`) ------------------

    def take_dirty(self) -> set[str]:
        """The nodes whose state changed since the last call (counters, rule windows)."""
        for host in self.classifier.take_touched():
            if host:
                self._dirty.add(host.split("/", 1)[0])
        out, self._dirty = self._dirty, set()
        return out

    def node_state(self, node: str) -> dict[str, Any]:
        """Everything this inspector remembers of ``node``."""
        return {
            "gpu": dict(self._gpu_prev.get(node, {})),
            "nic": dict(self._nic_prev.get(node, {})),
            "windows": self.classifier.windows_of(node),
            "overload_since": self._overload_since.get(node),
        }

    def restore_node(self, node: str, state: dict[str, Any]) -> None:
        """Take ``state`` (from :meth:`node_state`) as what is known of ``node``."""
        self._gpu_prev[node] = {int(k): dict(v) for k, v in state.get("gpu", {}).items()}
        self._nic_prev[node] = {str(k): v for k, v in state.get("nic", {}).items()}
        self.classifier.restore_windows(node, state.get("windows", []))
        since = state.get("overload_since")
        if isinstance(since, int | float) and not isinstance(since, bool):
            self._overload_since[node] = float(since)
        else:
            self._overload_since.pop(node, None)

    def drop_node(self, node: str) -> None:
        """Forget ``node`` (its partition moved to another worker)."""
        self._gpu_prev.pop(node, None)
        self._nic_prev.pop(node, None)
        self._overload_since.pop(node, None)
        self._dirty.discard(node)
        self.classifier.restore_windows(node, [])

    def nodes(self) -> set[str]:
        return (
            set(self._gpu_prev)
            | set(self._nic_prev)
            | set(self._overload_since)
            | self.classifier.window_nodes()
        )
