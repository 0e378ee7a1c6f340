"""Settings of a stream worker (`trainguard worker`): the ``worker`` section of the config file
and ``TRAINGUARD__WORKER__*`` variables.  Detector thresholds live in their own nested configs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from trainguard.detectors.capture import AggregationConfig
from trainguard.detectors.decide import DecideConfig
from trainguard.detectors.job_monitor import MonitorConfig
from trainguard.detectors.node_inspector import HostThresholds
from trainguard.detectors.registry import check_params
from trainguard.infra.sink import SinkConfig
from trainguard.schemas.topics import PREFIX, namespaced
from trainguard.schemas.typecheck import bounds

DEFAULT_APP_ID = "trainguard-worker"


@dataclass(frozen=True)
class WorkerConfig:
    """One stream worker; several workers with the same ``app_id`` share the partitions."""

    app_id: str = DEFAULT_APP_ID
    #: topic namespace: "" reads and writes the live topics; a name (``shadow``: where
    #: ``trainguard replay`` writes by default) maps every registry topic to its twin
    #: ``trainguard.<namespace>.<rest>`` (:func:`trainguard.schemas.topics.namespaced`), so the whole
    #: detection path runs on a replayed stream beside the live one.  Such a worker never runs the ClickHouse
    #: sink (the tables hold the live topics), and the default app id becomes
    #: ``trainguard-worker-<namespace>`` (a consumer group of its own).
    topic_namespace: str = ""
    #: where a new consumer group starts: "earliest" (process the retained history) or "latest".
    auto_offset_reset: str = "earliest"
    #: web server for /metrics and /healthz (Prometheus); 0 disables it.
    web_port: int = field(default=6066, metadata=bounds(0, 65535))
    web_host: str = "127.0.0.1"
    #: Kafka group timings: small values make a worker ready (and a dead one replaced) in seconds.
    session_timeout_s: float = field(default=6.0, metadata=bounds(1, 600))
    heartbeat_interval_s: float = field(default=2.0, metadata=bounds(0.1, 60))
    #: how often per-job time-based checks (stall, stragglers) run.
    check_interval_s: float = field(default=2.0, metadata=bounds(0.1, 600))
    #: keep detector state (rule windows, open incidents, job monitors, captures) in changelog topics
    #: (``<app_id>-state-<stage>-changelog``) so a restart or a rebalance does not forget it.
    state_enabled: bool = True
    #: a key's changed state is written at most this often (a job's monitor changes every step).
    state_flush_s: float = field(default=0.5, metadata=bounds(0.01, 600))
    #: an agent whose input has lag but made no progress for this long fails /healthz.
    liveness_stall_s: float = field(default=60.0, metadata=bounds(1, 86_400))
    #: log the event loop thread's stack when the loop has not run for this long (0: off;
    #: ``trainguard.streams.loop_watch``): every decision waits while it is blocked.
    loop_block_warn_s: float = field(default=1.0, metadata=bounds(0, 3600))
    #: run the ClickHouse sink (its own thread and consumer group, ``<app_id>-sink`` unless
    #: ``sink.group_id`` says otherwise); without it the agents dead-letter the garbage they see.
    sink_enabled: bool = True
    #: run that sink as a process of its own (``trainguard sink``, same group) instead of a thread
    #: here: its consumer, decoding and inserts then never share this worker's core and GIL (a
    #: quarter of the worker's CPU at 1,200 machines was the sink thread's).  The worker still
    #: leaves garbage to the sink to dead-letter, so run ``trainguard sink`` beside it.
    sink_process: bool = False
    #: hand the agents what is buffered on urgent topics (log lines, exits, detections, decisions,
    #: stack dumps...) before bulk telemetry (GPU, host, NIC, step samples):
    #: :mod:`trainguard.streams.priority`.
    urgent_first: bool = True
    #: at most this many records per fetch round (Faust's ``broker_max_poll_records``; 0: all that
    #: is buffered): how long an urgent record can wait for the round before it to be delivered.
    max_poll_records: int = field(default=100, metadata=bounds(0, 1_000_000))
    sink: SinkConfig = field(default_factory=SinkConfig)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    decide: DecideConfig = field(default_factory=DecideConfig)
    host: HostThresholds = field(default_factory=HostThresholds)
    #: feature-wise anomaly detector run on GPU samples per node (registry name; "" disables).
    anomaly_detector: str = "ewma_zscore"
    #: a node whose anomaly score exceeds this is reported (informational detection).
    anomaly_threshold: float = field(default=8.0, metadata=bounds(0, 1e9))
    #: the anomaly detector's parameters (its ``Params`` fields; unknown ones are errors).
    anomaly_params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.anomaly_detector:
            check_params(self.anomaly_detector, self.anomaly_params)
        if self.auto_offset_reset not in ("earliest", "latest"):
            raise ValueError("auto_offset_reset must be 'earliest' or 'latest'")
        if self.topic_namespace:
            namespaced(PREFIX, self.topic_namespace)  # a ValueError for a name Kafka would refuse
            object.__setattr__(self, "sink_enabled", False)
            if self.app_id == DEFAULT_APP_ID:
                object.__setattr__(self, "app_id", f"{DEFAULT_APP_ID}-{self.topic_namespace}")


def sink_config(cfg: WorkerConfig) -> SinkConfig:
    """The worker's sink settings with its group: ``<app_id>-sink`` unless ``sink.group_id`` is
    set -- the same for the sink thread and for ``trainguard sink`` (``sink_process``), so moving
    the sink out of the worker keeps its committed offsets."""
    return replace(cfg.sink, group_id=cfg.sink.group_id or f"{cfg.app_id}-sink")
