"""Settings of a stream worker (`trainguard worker`): the ``worker`` section of the config file
and ``TRAINGUARD__WORKER__*`` variables.  Detector thresholds live in their own nested configs."""

from __future__ import annotations

from dataclasses import dataclass, field

from detectors.capture import AggregationConfig
from detectors.decide import DecideConfig
from detectors.job_monitor import MonitorConfig
from detectors.node_inspector import HostThresholds
from schemas.typecheck import rng


@dataclass(frozen=True)
class SinkSettings:
    #: flush a ClickHouse batch at this many events ...
    batch_size: int = field(default=2_000, metadata=rng(1, 1_000_000))
    #: ... or after this many seconds.
    max_wait_s: float = field(default=1.0, metadata=rng(0.01, 600))
    retry_backoff_s: float = field(default=0.5, metadata=rng(0.01, 60))
    retry_backoff_max_s: float = field(default=10.0, metadata=rng(0.1, 600))


@dataclass(frozen=True)
class WorkerConfig:
    """One stream worker; several workers with the same ``app_id`` share the partitions."""

    app_id: str = "trainguard-worker"
    #: where a new consumer group starts: "earliest" (process the retained history) or "latest".
    auto_offset_reset: str = "earliest"
    #: web server for /metrics and /healthz (Prometheus); 0 disables it.
    web_port: int = field(default=6066, metadata=rng(0, 65535))
    web_host: str = "127.0.0.1"
    #: Kafka group timings: small values make a worker ready (and a dead one replaced) in seconds.
    session_timeout_s: float = field(default=6.0, metadata=rng(1, 600))
    heartbeat_interval_s: float = field(default=2.0, metadata=rng(0.1, 60))
    #: how often per-job time-based checks (stall, stragglers) run.
    check_interval_s: float = field(default=2.0, metadata=rng(0.1, 600))
    #: an agent whose input has lag but made no progress for this long fails /healthz.
    liveness_stall_s: float = field(default=60.0, metadata=rng(1, 86_400))
    sink_enabled: bool = True
    sink: SinkSettings = field(default_factory=SinkSettings)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    decide: DecideConfig = field(default_factory=DecideConfig)
    host: HostThresholds = field(default_factory=HostThresholds)
    #: feature-wise anomaly detector run on GPU samples per node (registry name; "" disables).
    anomaly_detector: str = "ewma_zscore"
    #: a node whose anomaly score exceeds this is reported (informational detection).
    anomaly_threshold: float = field(default=8.0, metadata=rng(0, 1e9))

    def __post_init__(self) -> None:
        if self.auto_offset_reset not in ("earliest", "latest"):
            raise ValueError("auto_offset_reset must be 'earliest' or 'latest'")
