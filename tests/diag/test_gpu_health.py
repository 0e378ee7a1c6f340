"""``gpu-health`` against a stand-in NVML (any object with pynvml's function names, as the exporter's
tests use): unsupported readings recorded as such, each limit's finding, Xid events, lost GPUs,
and the skip without a driver -- plus the real skip on this machine when it has no GPU.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from trainguard.diag import DiagContext, load_diag_config, run_test
from trainguard.diag.base import NOT_SUPPORTED
from trainguard.diag.devices import load_pynvml

_ABSENT = object()


class NvmlError(Exception):
    """Like pynvml's NVMLError: the return code in ``value``."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    """GPUs as dicts of readings; a reading left out raises NOT_SUPPORTED, ``lost`` GPUs raise
    GPU_IS_LOST on every call; ``events`` are (gpu index, xid) delivered by the event API."""

    NVML_NVLINK_MAX_LINKS = 18

    def __init__(
        self, gpus: list[dict[str, Any]], events: list[tuple[int, int]] | None = None, init_error: int = 0
    ):
        self.gpus, self.events, self.init_error = gpus, list(events or []), init_error
        self.shut_down = False
        self.waits: list[int] = []

    def _v(self, h: int, key: str) -> Any:
        gpu = self.gpus[h]
        if gpu.get("lost"):
            raise NvmlError(15)
        value = gpu.get(key, _ABSENT)
        if value is _ABSENT:
            raise NvmlError(3)
        return value

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NvmlError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.90.07"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._v(h, "name")

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return self._v(h, "uuid").encode()  # older bindings give bytes

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=self._v(h, "bus_id"))

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        return self._v(h, f"ecc_{kind}_{counter}")

    def nvmlDeviceGetRetiredPages(self, h: int, cause: int) -> list[int]:
        return self._v(h, f"retired_{cause}")

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        return self._v(h, "retired_pending")

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return self._v(h, "remapped_rows")

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:
        return self._v(h, "pcie_replays")

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= self._v(h, "nvlinks"):
            raise NvmlError(2)  # NVML_ERROR_INVALID_ARGUMENT: no such link
        return 1

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:
        return self._v(h, "nvlink_errors")[counter]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._v(h, "throttle")

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: int, types: int, event_set: str) -> None:
        assert types == 0x8 and event_set == "event-set"
        self._v(h, "xid_supported")

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        self.waits.append(timeout_ms)
        if self.events:
            index, xid = self.events.pop(0)
            return SimpleNamespace(device=index, eventData=xid)
        raise NvmlError(10)  # NVML_ERROR_TIMEOUT

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass


HEALTHY: dict[str, Any] = {
    "name": "NVIDIA H100 80GB HBM3",
    "uuid": "GPU-0000",
    "bus_id": "00000000:18:00.0",
    "ecc_1_0": 0,
    "ecc_1_1": 0,
    "ecc_0_0": 3,
    "ecc_0_1": 40,
    "remapped_rows": (2, 0, 0, 0),
    "pcie_replays": 0,
    "nvlinks": 2,
    "nvlink_errors": [0, 0, 1, 0],
    "throttle": 0x4,  # sw_power_cap: normal under load
    "xid_supported": True,
}


def _ctx(nvml: FakeNvml, **gpu_health: Any) -> DiagContext:
    cfg = load_diag_config("quick", {"gpu_health": {"xid_window_s": 0.0, **gpu_health}}, environ={})
    return DiagContext(cfg=cfg, nvml=nvml)


def test_a_healthy_gpu_passes_and_unsupported_readings_say_so() -> None:
    nvml = FakeNvml([HEALTHY])
    res = run_test("gpu-health", _ctx(nvml))
    assert res.passed is True and res.findings == [] and nvml.shut_down
    gpu = res.measured["gpus"][0]
    assert gpu["state"] == "ok" and gpu["uuid"] == "GPU-0000" and gpu["bus_id"] == "00000000:18:00.0"
    assert gpu["ecc_volatile_uncorrected"] == 0 and gpu["ecc_aggregate_corrected"] == 40
    assert gpu["remapped_rows"] == {"correctable": 2, "uncorrectable": 0, "pending": False, "failure": False}
    assert gpu["nvlink"] == {
        "active_links": [0, 1],
        "errors": {"replay": 0, "recovery": 0, "crc_flit": 2, "crc_data": 0},
    }
    assert gpu["throttle_reasons"] == ["sw_power_cap"] and gpu["xid_events"] == []
    # H100s remap rows instead of retiring pages: "not supported", never 0, never a crash
    assert gpu["retired_pages"] == {
        "multiple_single_bit_ecc": NOT_SUPPORTED,
        "double_bit_ecc": NOT_SUPPORTED,
    }
    assert gpu["retirement_pending"] == NOT_SUPPORTED
    assert res.thresholds["max_ecc_volatile_uncorrected"] == 0 and res.thresholds["max_pcie_replays"] is None
    assert res.measured["driver_version"] == "550.90.07" and res.measured["gpu_count"] == 1


def test_a_board_that_supports_nothing_passes_with_everything_not_supported() -> None:
    res = run_test("gpu-health", _ctx(FakeNvml([{}])))
    assert res.passed is True
    gpu = res.measured["gpus"][0]
    for key in (
        "name",
        "uuid",
        "ecc_volatile_uncorrected",
        "pcie_replays",
        "remapped_rows",
        "nvlink",
        "xid_events",
    ):
        assert gpu[key] == NOT_SUPPORTED, key
    assert gpu["throttle_mask"] == NOT_SUPPORTED  # the newer call missing, the older one absent


def test_every_limit_gives_its_finding() -> None:
    bad = {
        **HEALTHY,
        "uuid": "GPU-0001",
        "bus_id": "00000000:2A:00.0",
        "ecc_1_0": 2,
        "remapped_rows": (5, 3, 1, 1),
        "pcie_replays": 120,
        "nvlink_errors": [10, 0, 0, 0],
        "throttle": 0x8 | 0x40,
    }
    nvml = FakeNvml([HEALTHY, bad], events=[(1, 79), (0, 43)])
    res = run_test("gpu-health", _ctx(nvml, max_pcie_replays=100, max_nvlink_errors=5))
    where = "gpu 1 (00000000:2A:00.0)"
    assert res.passed is False
    assert res.findings == [
        f"{where}: uncorrectable ECC errors since the driver loaded 2 > 0 (max_ecc_volatile_uncorrected)",
        f"{where}: a row remap is pending (a GPU reset applies it)",
        f"{where}: a row remap failed (no spare rows left)",
        f"{where}: PCIe replays 120 > 100 (max_pcie_replays)",
        f"{where}: NVLink errors 20 > 5 (max_nvlink_errors)",
        f"{where}: clocks held down by hw_slowdown, hw_thermal_slowdown",
        "1 Xid event(s) in 0 s > 0: gpu 1: Xid 79",  # Xid 43 is the application's: ignored
    ]
    assert res.measured["gpus"][1]["xid_events"] == [79] and res.measured["gpus"][0]["xid_events"] == [43]


def test_xid_window_waits_and_retired_pages_count() -> None:
    old = {**HEALTHY, "retired_0": [1] * 40, "retired_1": [2] * 25, "retired_pending": 1}
    del old["remapped_rows"]
    nvml = FakeNvml([old])
    res = run_test("gpu-health", _ctx(nvml, xid_window_s=0.2))
    assert res.findings == [
        "gpu 0 (00000000:18:00.0): retired pages 65 > 59 (max_retired_pages)",
        "gpu 0 (00000000:18:00.0): a page retirement is pending (a GPU reset applies it)",
    ]
    assert 0 < nvml.waits[0] <= 200  # the window was waited for through the event API


def test_a_lost_gpu_and_a_missing_one_are_findings() -> None:
    nvml = FakeNvml([HEALTHY, {"lost": True}])
    res = run_test("gpu-health", _ctx(nvml, expect_gpus=3))
    assert res.passed is False
    assert res.findings == [
        "NVML sees 2 GPU(s), 3 expected (expect_gpus)",
        "gpu 1: lost (NVML_ERROR_GPU_IS_LOST: fallen off the bus)",
    ]


@pytest.mark.parametrize(
    ("code", "reason"),
    [(12, "no NVIDIA driver: the NVML library is not installed"), (9, "no NVIDIA driver loaded")],
)
def test_no_driver_is_a_skip(code: int, reason: str) -> None:
    res = run_test("gpu-health", _ctx(FakeNvml([], init_error=code)))
    assert res.passed is None and str(res.skipped_reason).startswith(reason) and res.findings == []


def test_nvml_that_does_not_start_fails() -> None:
    res = run_test("gpu-health", _ctx(FakeNvml([HEALTHY], init_error=18)))  # LIB_RM_VERSION_MISMATCH
    assert res.passed is False and res.findings == ["NVML failed to initialise: NvmlError NVML error 18"]


def test_no_gpu_is_a_skip() -> None:
    res = run_test("gpu-health", _ctx(FakeNvml([])))
    assert res.passed is None and res.skipped_reason == "no GPU: NVML found none"


def _machine_has_nvml() -> bool:
    try:
        nvml = load_pynvml()
        nvml.nvmlInit()
    except Exception:
        return False
    nvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_machine_has_nvml(), reason="this machine has an NVIDIA driver")
def test_this_machine_without_a_driver_skips_with_the_reason() -> None:
    res = run_test("gpu-health", DiagContext(cfg=load_diag_config("quick", environ={})))
    assert res.passed is None and res.findings == []
    assert str(res.skipped_reason).startswith(("no NVIDIA driver", "pynvml is not installed"))
