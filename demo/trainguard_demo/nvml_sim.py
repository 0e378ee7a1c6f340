"""A simulated NVML with pynvml's function names, for tests, benches and GPU-less machines.

Errors are real ``pynvml.NVMLError`` instances with real return codes (``GPU_IS_LOST``,
``NOT_SUPPORTED``, ``TIMEOUT``, ...), so the ``nvml`` source runs the exact code path it runs on
a GPU node.  Each :class:`SimGpu` is a mutable board: raise its temperature, mark it lost, queue an
Xid, remove support for a field.
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    import pynvml

NVML_NVLINK_MAX_LINKS = 18


@dataclass
class SimGpu:
    """One simulated board; values in NVML's units (mW, bytes, MHz)."""

    uuid: str
    bus_id: str
    util_gpu: int = 95
    util_mem: int = 40
    mem_used: int = 60 * 2**30
    mem_total: int = 80 * 2**30
    temperature_c: int = 62
    power_mw: int = 550_000
    sm_clock_mhz: int = 1980
    throttle_mask: int = 0
    ecc: dict[tuple[int, int], int] = field(
        default_factory=lambda: {(0, 0): 0, (1, 0): 0, (0, 1): 2, (1, 1): 0}
    )
    retired_pending: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    pcie_replay: int = 0
    nvlinks: int = 18
    nvlink_errors: int = 0
    lost: bool = False
    #: pynvml function names this board answers with NOT_SUPPORTED.
    unsupported: set[str] = field(default_factory=set)
    events: deque[tuple[int, int]] = field(default_factory=deque)  # (event type, xid)


class SimulatedNvml:
    """The subset of pynvml the ``nvml`` source calls, over simulated boards."""

    NVML_NVLINK_MAX_LINKS = NVML_NVLINK_MAX_LINKS

    def __init__(self, gpus: int | list[SimGpu] = 8, *, driver_loaded: bool = True) -> None:
        self.gpus = (
            [
                SimGpu(uuid=f"GPU-sim-{i:04d}", bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0")
                for i in range(gpus)
            ]
            if isinstance(gpus, int)
            else gpus
        )
        self.driver_loaded = driver_loaded
        self.inited = 0
        self.calls = 0

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _err(code: int) -> pynvml.NVMLError:
        return pynvml.NVMLError(code)

    def _gpu(self, handle: Any, fn: str) -> SimGpu:
        self.calls += 1
        if not self.inited:
            raise self._err(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu: SimGpu = handle.gpu
        if gpu.lost:
            raise self._err(pynvml.NVML_ERROR_GPU_IS_LOST)
        if fn in gpu.unsupported:
            raise self._err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def xid(self, index: int, xid: int) -> None:
        """Queue an Xid critical error on GPU ``index`` (as the driver would)."""
        self.gpus[index].events.append((pynvml.nvmlEventTypeXidCriticalError, xid))

    # -- pynvml API ----------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if not self.driver_loaded:
            raise self._err(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self.inited += 1

    def nvmlShutdown(self) -> None:
        self.inited = max(0, self.inited - 1)

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= index < len(self.gpus):
            raise self._err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        handle = SimpleNamespace(gpu=self.gpus[index], index=index)
        self._gpu(handle, "nvmlDeviceGetHandleByIndex")
        return handle

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return int(handle.index)

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        return self._gpu(h, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        return SimpleNamespace(busId=self._gpu(h, "nvmlDeviceGetPciInfo").bus_id)

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        g = self._gpu(h, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=g.util_gpu, memory=g.util_mem)

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        g = self._gpu(h, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(used=g.mem_used, total=g.mem_total, free=g.mem_total - g.mem_used)

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        return self._gpu(h, "nvmlDeviceGetTemperature").temperature_c

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetClockInfo(self, h: Any, clock: int) -> int:
        return self._gpu(h, "nvmlDeviceGetClockInfo").sm_clock_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetCurrentClocksEventReasons").throttle_mask

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetCurrentClocksThrottleReasons").throttle_mask

    def nvmlDeviceGetTotalEccErrors(self, h: Any, error_type: int, counter_type: int) -> int:
        return self._gpu(h, "nvmlDeviceGetTotalEccErrors").ecc[(error_type, counter_type)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetRetiredPagesPendingStatus").retired_pending

    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple[int, int, int, int]:
        return self._gpu(h, "nvmlDeviceGetRemappedRows").remapped_rows

    def nvmlDeviceGetPcieReplayCounter(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetPcieReplayCounter").pcie_replay

    def nvmlDeviceGetNvLinkState(self, h: Any, link: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetNvLinkState")
        if link >= g.nvlinks:
            raise self._err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 1

    def nvmlDeviceGetNvLinkErrorCounter(self, h: Any, link: int, counter: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetNvLinkErrorCounter")
        # all errors on link 0's replay counter: enough to check that they are summed.
        return g.nvlink_errors if (link, counter) == (0, 0) else 0

    def nvmlEventSetCreate(self) -> Any:
        return SimpleNamespace(devices=[])

    def nvmlDeviceRegisterEvents(self, h: Any, types: int, event_set: Any) -> None:
        self._gpu(h, "nvmlDeviceRegisterEvents")
        event_set.devices.append(h)

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        for h in event_set.devices:
            if h.gpu.events:
                etype, xid = h.gpu.events.popleft()
                return SimpleNamespace(device=h, eventType=etype, eventData=xid)
        raise self._err(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: Any) -> None:
        event_set.devices.clear()
