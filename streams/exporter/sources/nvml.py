"""``nvml`` source: per-GPU samples through NVML and Xid events through NVML's event API.

Samples utilisation, memory, temperature, power, SM clock and throttle (clocks-event) reasons,
ECC counters (volatile/aggregate x corrected/uncorrected), retired-page and row-remapping state,
the PCIe replay counter and NVLink error counters.  A field the board does not support is None.
"No library / no driver" and ``NVML_ERROR_GPU_IS_LOST`` are GPU *states* in the batch, never
crashes.  ``nvml`` is any object with pynvml's function names (the module itself by default;
the demo's simulated GPUs in tests, benches and simulated machines).
An Xid event is published as a kernel-style ``NVRM: Xid`` log line so one rule table serves both.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.telemetry import GpuSample, GpuSampleBatch, GpuState, decode_throttle
from trainguard.schemas.workload import LogLine
from trainguard.streams.exporter.sources.base import SourceContext, register

log = logging.getLogger(__name__)

#: NVML return codes used here (nvml.h); stable across driver versions.
ERROR_NOT_SUPPORTED = 3
ERROR_LIBRARY_NOT_FOUND = 12
ERROR_TIMEOUT = 10
ERROR_DRIVER_NOT_LOADED = 9
ERROR_GPU_IS_LOST = 15
ERROR_FUNCTION_NOT_FOUND = 13

#: NVLink error counters summed into ``nvlink_errors`` (DL replay, recovery, CRC flit, CRC data).
NVLINK_COUNTERS = (0, 1, 2, 3)
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError


def build_gpu_sample(index: int, raw: dict[str, Any]) -> GpuSample:
    """A GpuSample from the raw NVML readings of one device (pure; units converted here).

    >>> s = build_gpu_sample(0, {"power_mw": 612345, "throttle_mask": 0x40, "util_gpu": 97})
    >>> s.power_w, s.throttle_reasons, s.util_gpu_pct
    (612.345, ['hw_thermal_slowdown'], 97.0)
    """
    mask = raw.get("throttle_mask")
    power = raw.get("power_mw")
    util_gpu, util_mem = raw.get("util_gpu"), raw.get("util_mem")
    temp = raw.get("temperature_c")
    return GpuSample(
        index=index,
        uuid=raw.get("uuid", ""),
        util_gpu_pct=None if util_gpu is None else float(min(100, util_gpu)),
        util_mem_pct=None if util_mem is None else float(min(100, util_mem)),
        mem_used_bytes=raw.get("mem_used"),
        mem_total_bytes=raw.get("mem_total"),
        temperature_c=None if temp is None else float(temp),
        power_w=None if power is None else power / 1000.0,
        sm_clock_mhz=raw.get("sm_clock_mhz"),
        throttle_mask=mask,
        throttle_reasons=decode_throttle(mask) if mask is not None else [],
        ecc_volatile_corrected=raw.get("ecc_volatile_corrected"),
        ecc_volatile_uncorrected=raw.get("ecc_volatile_uncorrected"),
        ecc_aggregate_corrected=raw.get("ecc_aggregate_corrected"),
        ecc_aggregate_uncorrected=raw.get("ecc_aggregate_uncorrected"),
        retired_pages_pending=raw.get("retired_pages_pending"),
        remapped_rows_correctable=raw.get("remapped_rows_correctable"),
        remapped_rows_uncorrectable=raw.get("remapped_rows_uncorrectable"),
        remap_pending=raw.get("remap_pending"),
        remap_failure=raw.get("remap_failure"),
        pcie_replay_count=raw.get("pcie_replay_count"),
        nvlink_errors=raw.get("nvlink_errors"),
    )


def xid_line(bus_id: str, xid: int, data: int = 0) -> str:
    """An Xid event in the driver's kernel-log format (the classifier's input).

    >>> xid_line("00000000:3B:00.0", 79)
    "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, reported through the NVML event API"
    """
    # NVML gives "00000000:3B:00.0"; the kernel prints "0000:3b:00".
    parts = bus_id.lower().split(":")
    short = f"{parts[-3][-4:]}:{parts[-2]}:{parts[-1].split('.')[0]}" if len(parts) >= 3 else bus_id.lower()
    extra = f" (data 0x{data:x})" if data else ""
    who = "pid='<unknown>', name=<unknown>, reported through the NVML event API"
    return f"NVRM: Xid (PCI:{short}): {xid}, {who}{extra}"


def _load_pynvml() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "pynvml is deprecated": same API either way
        import pynvml

    return pynvml


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


class NvmlSource:
    name = "nvml"

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg.nvml
        self.nvml: Any = ctx.nvml
        self._inited = False
        self._event_set: Any = None
        self._bus_ids: dict[int, str] = {}

    # -- NVML plumbing -------------------------------------------------------------------------
    def _init(self) -> str:
        """Initialise NVML once; return "" or the reason it is unavailable."""
        if self._inited:
            return ""
        try:
            if self.nvml is None:
                self.nvml = _load_pynvml()
            self.nvml.nvmlInit()
        except ImportError as exc:
            return f"pynvml not importable: {exc}"
        except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...
            return f"NVML unavailable: {exc}"
        self._inited = True
        if self.cfg.xid_events:
            self._setup_events()
        return ""

    def _setup_events(self) -> None:
        try:
            self._event_set = self.nvml.nvmlEventSetCreate()
            count = self.nvml.nvmlDeviceGetCount()
        except Exception as exc:
            log.warning("NVML event API unavailable: %s", exc)
            self._event_set = None
            return
        for i in range(count):
            try:  # per device: one lost or event-less GPU must not cost the others their Xids
                h = self.nvml.nvmlDeviceGetHandleByIndex(i)
                self._bus_ids[i] = _text(self.nvml.nvmlDeviceGetPciInfo(h).busId)
                self.nvml.nvmlDeviceRegisterEvents(h, XID_EVENT, self._event_set)
            except Exception as exc:
                log.info("gpu %d: no Xid events: %s", i, exc)

    def _get(self, fn: str, *args: Any) -> Any:
        """One NVML call; None where the board does not support it. GPU lost propagates."""
        try:
            return getattr(self.nvml, fn)(*args)
        except AttributeError:
            return None  # older bindings lack the call
        except Exception as exc:
            code = _code(exc)
            if code == ERROR_GPU_IS_LOST:
                raise
            if code not in (ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND):
                log.debug("%s%s: %s", fn, args[1:], exc)
            return None

    def read_raw(self, h: Any) -> dict[str, Any]:
        n = self.nvml
        raw: dict[str, Any] = {"uuid": _text(self._get("nvmlDeviceGetUUID", h) or "")}
        util = self._get("nvmlDeviceGetUtilizationRates", h)
        if util is not None:
            raw["util_gpu"], raw["util_mem"] = util.gpu, util.memory
        mem = self._get("nvmlDeviceGetMemoryInfo", h)
        if mem is not None:
            raw["mem_used"], raw["mem_total"] = mem.used, mem.total
        raw["temperature_c"] = self._get("nvmlDeviceGetTemperature", h, 0)  # NVML_TEMPERATURE_GPU
        raw["power_mw"] = self._get("nvmlDeviceGetPowerUsage", h)
        raw["sm_clock_mhz"] = self._get("nvmlDeviceGetClockInfo", h, 1)  # NVML_CLOCK_SM
        mask = self._get("nvmlDeviceGetCurrentClocksEventReasons", h)
        raw["throttle_mask"] = (
            mask if mask is not None else self._get("nvmlDeviceGetCurrentClocksThrottleReasons", h)
        )
        for kind, kname in ((0, "corrected"), (1, "uncorrected")):  # NVML_MEMORY_ERROR_TYPE_*
            for counter, cname in ((0, "volatile"), (1, "aggregate")):  # NVML_VOLATILE_ECC / AGGREGATE
                raw[f"ecc_{cname}_{kname}"] = self._get("nvmlDeviceGetTotalEccErrors", h, kind, counter)
        pending = self._get("nvmlDeviceGetRetiredPagesPendingStatus", h)
        raw["retired_pages_pending"] = None if pending is None else bool(pending)
        rows = self._get("nvmlDeviceGetRemappedRows", h)
        if rows is not None:
            corr, unc, is_pending, failed = rows
            raw.update(
                remapped_rows_correctable=corr,
                remapped_rows_uncorrectable=unc,
                remap_pending=bool(is_pending),
                remap_failure=bool(failed),
            )
        raw["pcie_replay_count"] = self._get("nvmlDeviceGetPcieReplayCounter", h)
        raw["nvlink_errors"] = self._nvlink_errors(h, n)
        return raw

    def _nvlink_errors(self, h: Any, n: Any) -> int | None:
        total, seen = 0, False
        for link in range(int(getattr(n, "NVML_NVLINK_MAX_LINKS", 18))):
            if self._get("nvmlDeviceGetNvLinkState", h, link) is None:
                break  # links are numbered densely: the first unsupported one ends the list
            for counter in NVLINK_COUNTERS:
                value = self._get("nvmlDeviceGetNvLinkErrorCounter", h, link, counter)
                if value is not None:
                    total, seen = total + int(value), True
        return total if seen else None

    def _xid_events(self) -> list[Event]:
        if self._event_set is None:
            return []
        out: list[Event] = []
        for _ in range(1000):  # bounded drain of the driver's queue, never waiting
            try:
                data = self.nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except Exception as exc:
                if _code(exc) != ERROR_TIMEOUT:
                    log.warning("NVML event wait: %s", exc)
                break
            index = self._index_of(data.device)
            line = xid_line(
                self._bus_ids.get(index, "unknown"),
                int(data.eventData),
                int(getattr(data, "eventDataExt", 0) or 0),
            )
            out.append(
                LogLine(node=self.ctx.node, ts_ms=now_ms(), source="nvml", line=line, job=self.ctx.job)
            )
        return out

    def _index_of(self, handle: Any) -> int:
        try:
            return int(self.nvml.nvmlDeviceGetIndex(handle))
        except Exception:
            return -1

    # -- Source --------------------------------------------------------------------------------
    def collect(self) -> list[Event]:
        ts = now_ms()
        reason = self._init()
        if reason:
            gpus = [
                GpuSample(index=i, state=GpuState.NO_DRIVER, error=reason[:4096])
                for i in range(max(1, self.cfg.expect_gpus))
            ]
            return [GpuSampleBatch(node=self.ctx.node, ts_ms=ts, gpus=gpus, job=self.ctx.job)]
        count = int(self.nvml.nvmlDeviceGetCount())
        gpus = [self._sample(i) for i in range(count)]
        gpus += [
            GpuSample(index=i, state=GpuState.UNAVAILABLE, error="missing from the NVML inventory")
            for i in range(count, self.cfg.expect_gpus)
        ]
        events: list[Event] = [GpuSampleBatch(node=self.ctx.node, ts_ms=ts, gpus=gpus, job=self.ctx.job)]
        return events + self._xid_events()

    def _sample(self, index: int) -> GpuSample:
        try:
            h = self.nvml.nvmlDeviceGetHandleByIndex(index)
            return build_gpu_sample(index, self.read_raw(h))
        except Exception as exc:
            state = GpuState.LOST if _code(exc) == ERROR_GPU_IS_LOST else GpuState.UNAVAILABLE
            return GpuSample(index=index, state=state, error=str(exc)[:4096] or type(exc).__name__)

    def close(self) -> None:
        if not self._inited:
            return
        try:
            if self._event_set is not None:
                self.nvml.nvmlEventSetFree(self._event_set)
            self.nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("NVML shutdown: %s", exc)
        self._inited = False


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@register("nvml")
def _factory(ctx: SourceContext) -> NvmlSource:
    return NvmlSource(ctx)
