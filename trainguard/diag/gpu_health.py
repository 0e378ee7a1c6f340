"""``gpu-health``: each GPU's NVML error counters and states against the configured limits, and
the Xid events NVML reports while the test watches.

Read per GPU: uncorrectable ECC errors (volatile: since the driver loaded; aggregate: the board's
life; corrected ones are recorded only), retired pages and a pending retirement, row remapping
(correctable/uncorrectable rows, pending, failed), the PCIe replay counter, NVLink error counters
(replay, recovery, CRC flit, CRC data, summed over the active links) and the current clocks-event
(throttle) reasons.  Then Xid events are awaited for ``xid_window_s`` through NVML's event API
(``nvmlEventSetCreate`` / ``nvmlEventSetWait``).

A reading the board or driver does not support is recorded as ``"not supported"`` and checked
against nothing -- never a crash, never a zero.  No NVML library or no driver: skipped, with the
reason.  A GPU that fell off the bus (``NVML_ERROR_GPU_IS_LOST``) is a finding.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict
from typing import Any

from trainguard.diag.base import NOT_SUPPORTED, DiagContext, DiagResult, Skipped, register
from trainguard.diag.config import GpuHealthConfig
from trainguard.diag.devices import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    load_pynvml,
    nvml_code,
)
from trainguard.schemas.telemetry import decode_throttle

#: nvmlEventTypeXidCriticalError.
XID_EVENT = 0x8
#: NVLink error counters (nvmlNvLinkErrorCounter_t) by name.
NVLINK_COUNTERS = (("replay", 0), ("recovery", 1), ("crc_flit", 2), ("crc_data", 3))
#: nvmlMemoryErrorType_t x nvmlEccCounterType_t.
ECC_READINGS = (
    ("ecc_volatile_uncorrected", 1, 0),
    ("ecc_aggregate_uncorrected", 1, 1),
    ("ecc_volatile_corrected", 0, 0),
    ("ecc_aggregate_corrected", 0, 1),
)
#: nvmlPageRetirementCause_t.
RETIREMENT_CAUSES = (("multiple_single_bit_ecc", 0), ("double_bit_ecc", 1))


class NvmlInitError(Exception):
    """NVML is installed but does not start (reported as a finding)."""


class GpuLost(Exception):
    """NVML says the GPU fell off the bus."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Reader:
    """NVML calls for one GPU, each unsupported one recorded as such in ``out``."""

    def __init__(self, nvml: Any, handle: Any, out: dict[str, Any]) -> None:
        self.nvml, self.handle, self.out = nvml, handle, out

    def get(self, key: str, fn: str, *args: Any) -> Any:
        """``nvml.<fn>(handle, *args)``; stores and returns the value, or stores why there is
        none and returns None.  A lost GPU raises :class:`GpuLost`."""
        try:
            call = getattr(self.nvml, fn)
        except AttributeError:  # bindings older than the call
            self.out[key] = NOT_SUPPORTED
            return None
        try:
            value = call(self.handle, *args)
        except Exception as exc:
            code = nvml_code(exc)
            if code == NVML_ERROR_GPU_IS_LOST:
                raise GpuLost(str(exc)) from None
            if code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
                self.out[key] = NOT_SUPPORTED
            else:
                self.out[key] = f"error: {exc}"
            return None
        self.out[key] = value
        return value


def read_gpu(nvml: Any, handle: Any) -> dict[str, Any]:
    """Every reading of one GPU (pure apart from the NVML calls; values as NVML gives them)."""
    dev: dict[str, Any] = {}
    r = _Reader(nvml, handle, dev)
    for key, fn in (("name", "nvmlDeviceGetName"), ("uuid", "nvmlDeviceGetUUID")):
        value = r.get(key, fn)
        if value is not None:
            dev[key] = _text(value)
    pci = r.get("bus_id", "nvmlDeviceGetPciInfo")
    if pci is not None:
        dev["bus_id"] = _text(pci.busId)
    for key, kind, counter in ECC_READINGS:
        r.get(key, "nvmlDeviceGetTotalEccErrors", kind, counter)
    retired: dict[str, Any] = {}
    for cause, code in RETIREMENT_CAUSES:
        pages = _Reader(nvml, handle, retired).get(cause, "nvmlDeviceGetRetiredPages", code)
        if pages is not None:
            retired[cause] = len(pages)
    dev["retired_pages"] = retired
    pending = r.get("retirement_pending", "nvmlDeviceGetRetiredPagesPendingStatus")
    if pending is not None:
        dev["retirement_pending"] = bool(pending)
    rows = r.get("remapped_rows", "nvmlDeviceGetRemappedRows")
    if rows is not None:
        corr, unc, is_pending, failed = rows
        dev["remapped_rows"] = {
            "correctable": int(corr),
            "uncorrectable": int(unc),
            "pending": bool(is_pending),
            "failure": bool(failed),
        }
    r.get("pcie_replays", "nvmlDeviceGetPcieReplayCounter")
    dev["nvlink"] = _nvlink(nvml, handle)
    mask = r.get("throttle_mask", "nvmlDeviceGetCurrentClocksEventReasons")
    if mask is None:  # bindings/drivers before the rename
        mask = r.get("throttle_mask", "nvmlDeviceGetCurrentClocksThrottleReasons")
    if mask is not None:
        dev["throttle_reasons"] = decode_throttle(int(mask))
    return dev


def _nvlink(nvml: Any, handle: Any) -> dict[str, Any] | str:
    """Active links and their error counters summed per kind, or "not supported"."""
    links: list[int] = []
    totals: dict[str, Any] = {}
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        probe: dict[str, Any] = {}
        state = _Reader(nvml, handle, probe).get("state", "nvmlDeviceGetNvLinkState", link)
        if state is None:
            break  # links are numbered densely: the first missing one ends the list
        if not state:
            continue  # an inactive link counts nothing
        links.append(link)
        for name, counter in NVLINK_COUNTERS:
            value = _Reader(nvml, handle, probe).get(name, "nvmlDeviceGetNvLinkErrorCounter", link, counter)
            if value is None:
                totals.setdefault(name, NOT_SUPPORTED)
            else:
                prior = totals.get(name)
                totals[name] = int(value) + (prior if isinstance(prior, int) else 0)
    if not links:
        return NOT_SUPPORTED
    return {"active_links": links, "errors": totals}


def _nvlink_total(nvlink: Any) -> int | None:
    if not isinstance(nvlink, dict):
        return None
    values = [v for v in nvlink["errors"].values() if isinstance(v, int)]
    return sum(values) if values else None


def check_gpu(where: str, dev: dict[str, Any], cfg: GpuHealthConfig, result: DiagResult) -> None:
    """Compare one GPU's readings with the limits; one finding per limit exceeded."""

    def at_most(key: str, value: Any, limit: int | None, what: str) -> None:
        if limit is not None and isinstance(value, int) and not isinstance(value, bool) and value > limit:
            result.fail(f"{where}: {what} {value} > {limit} ({key})")

    at_most(
        "max_ecc_volatile_uncorrected",
        dev.get("ecc_volatile_uncorrected"),
        cfg.max_ecc_volatile_uncorrected,
        "uncorrectable ECC errors since the driver loaded",
    )
    at_most(
        "max_ecc_aggregate_uncorrected",
        dev.get("ecc_aggregate_uncorrected"),
        cfg.max_ecc_aggregate_uncorrected,
        "uncorrectable ECC errors over the board's life",
    )
    retired = dev.get("retired_pages") or {}
    counts = [v for v in retired.values() if isinstance(v, int)]
    if counts:
        at_most("max_retired_pages", sum(counts), cfg.max_retired_pages, "retired pages")
    if cfg.fail_on_retirement_pending and dev.get("retirement_pending") is True:
        result.fail(f"{where}: a page retirement is pending (a GPU reset applies it)")
    rows = dev.get("remapped_rows")
    if isinstance(rows, dict):
        if cfg.fail_on_remap_pending and rows["pending"]:
            result.fail(f"{where}: a row remap is pending (a GPU reset applies it)")
        if cfg.fail_on_remap_failure and rows["failure"]:
            result.fail(f"{where}: a row remap failed (no spare rows left)")
        at_most(
            "max_remapped_rows_uncorrectable",
            rows["uncorrectable"],
            cfg.max_remapped_rows_uncorrectable,
            "rows remapped for uncorrectable errors",
        )
    at_most("max_pcie_replays", dev.get("pcie_replays"), cfg.max_pcie_replays, "PCIe replays")
    at_most("max_nvlink_errors", _nvlink_total(dev.get("nvlink")), cfg.max_nvlink_errors, "NVLink errors")
    bad = [r for r in dev.get("throttle_reasons", []) if r in cfg.fail_throttle_reasons]
    if bad:
        result.fail(f"{where}: clocks held down by {', '.join(bad)}")


class _XidWatch:
    """NVML's Xid events of every GPU, registered before the counters are read."""

    def __init__(self, nvml: Any, handles: dict[int, Any], devices: dict[int, dict[str, Any]]) -> None:
        self.nvml = nvml
        self.event_set: Any = None
        self.index_of: dict[str, int] = {}
        try:
            self.event_set = nvml.nvmlEventSetCreate()
        except Exception as exc:
            for dev in devices.values():
                dev["xid_events"] = NOT_SUPPORTED if _unsupported(exc) else f"error: {exc}"
            return
        for i, h in handles.items():
            try:
                nvml.nvmlDeviceRegisterEvents(h, XID_EVENT, self.event_set)
                devices[i]["xid_events"] = []
            except Exception as exc:
                devices[i]["xid_events"] = NOT_SUPPORTED if _unsupported(exc) else f"error: {exc}"
            uuid = devices[i].get("uuid")
            if isinstance(uuid, str):
                self.index_of[uuid] = i

    def wait(self, window_s: float, devices: dict[int, dict[str, Any]]) -> list[tuple[int, int]]:
        """(gpu index, xid) of every event until ``window_s`` has passed (-1: unknown GPU)."""
        if self.event_set is None:
            return []
        seen: list[tuple[int, int]] = []
        deadline = time.monotonic() + window_s
        while len(seen) < 1000:  # bounded: a GPU in an Xid storm must not keep the test forever
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            try:
                data = self.nvml.nvmlEventSetWait_v2(self.event_set, left_ms)
            except Exception as exc:
                # A timeout ends the window (with 0 ms left: nothing more is queued).
                if nvml_code(exc) != NVML_ERROR_TIMEOUT:
                    for dev in devices.values():
                        if isinstance(dev.get("xid_events"), list):
                            dev.setdefault("xid_wait_error", str(exc))
                break
            index = self._index(data.device)
            xid = int(data.eventData)
            seen.append((index, xid))
            if index in devices and isinstance(devices[index].get("xid_events"), list):
                devices[index]["xid_events"].append(xid)
        return seen

    def _index(self, handle: Any) -> int:
        try:
            return int(self.nvml.nvmlDeviceGetIndex(handle))
        except Exception:
            pass
        try:
            return self.index_of.get(_text(self.nvml.nvmlDeviceGetUUID(handle)), -1)
        except Exception:
            return -1

    def close(self) -> None:
        if self.event_set is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlEventSetFree(self.event_set)


def _unsupported(exc: BaseException) -> bool:
    return nvml_code(exc) in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND)


def _init(ctx: DiagContext) -> Any:
    """NVML, initialised; :class:`Skipped` where this node has no NVIDIA library or driver."""
    try:
        nvml = ctx.nvml if ctx.nvml is not None else load_pynvml()
    except ImportError as exc:
        raise Skipped(f"pynvml is not installed ({exc}): install trainguard[node]") from None
    try:
        nvml.nvmlInit()
    except Exception as exc:
        code = nvml_code(exc)
        if code == NVML_ERROR_LIBRARY_NOT_FOUND:
            raise Skipped(f"no NVIDIA driver: the NVML library is not installed ({exc})") from None
        if code == NVML_ERROR_DRIVER_NOT_LOADED:
            raise Skipped(f"no NVIDIA driver loaded ({exc})") from None
        # Anything else (a driver/library version mismatch after an upgrade, ...) is the node's.
        raise NvmlInitError(f"NVML failed to initialise: {type(exc).__name__} {exc}".rstrip()) from None
    return nvml


@register("gpu-health", "NVML error counters, row remapping, throttling and Xid events per GPU")
def run(ctx: DiagContext, result: DiagResult) -> None:
    cfg: GpuHealthConfig = ctx.section("gpu-health")
    result.thresholds = asdict(cfg)
    try:
        nvml = _init(ctx)
    except NvmlInitError as exc:
        result.fail(str(exc))
        return
    try:
        _run(nvml, cfg, ctx, result)
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _run(nvml: Any, cfg: GpuHealthConfig, ctx: DiagContext, result: DiagResult) -> None:
    count = int(nvml.nvmlDeviceGetCount())
    result.measured["driver_version"] = _driver_version(nvml)
    result.measured["gpu_count"] = count
    if cfg.expect_gpus and count < cfg.expect_gpus:
        result.fail(f"NVML sees {count} GPU(s), {cfg.expect_gpus} expected (expect_gpus)")
    if count == 0:
        if cfg.expect_gpus:
            return
        raise Skipped("no GPU: NVML found none")
    devices: dict[int, dict[str, Any]] = {}
    handles: dict[int, Any] = {}
    for i in range(count):
        devices[i] = {"index": i}
        try:
            handles[i] = nvml.nvmlDeviceGetHandleByIndex(i)
        except Exception as exc:
            devices[i]["state"] = "lost" if nvml_code(exc) == NVML_ERROR_GPU_IS_LOST else f"error: {exc}"
            continue
        try:  # before the Xid watch: it maps an event's GPU by UUID where the index call fails
            devices[i]["uuid"] = _text(nvml.nvmlDeviceGetUUID(handles[i]))
        except Exception as exc:
            if nvml_code(exc) == NVML_ERROR_GPU_IS_LOST:
                devices[i]["state"] = "lost"
                handles.pop(i)
    ctx.progress(f"gpu-health: {count} GPU(s), watching Xid events for {cfg.xid_window_s:g} s")
    watch = _XidWatch(nvml, handles, devices)
    try:
        for i, h in handles.items():
            try:
                readings = read_gpu(nvml, h)
            except GpuLost as exc:
                devices[i]["state"] = "lost"
                devices[i]["error"] = str(exc)
                continue
            devices[i] = {**devices[i], **readings, "state": "ok"}
        xids = watch.wait(cfg.xid_window_s, devices)
    finally:
        watch.close()
    for i, dev in devices.items():
        where = f"gpu {i}" + (f" ({dev['bus_id']})" if isinstance(dev.get("bus_id"), str) else "")
        if dev.get("state") == "lost":
            result.fail(f"{where}: lost (NVML_ERROR_GPU_IS_LOST: fallen off the bus)")
        elif dev.get("state") != "ok":
            result.fail(f"{where}: NVML cannot query it: {dev.get('state')}")
        else:
            check_gpu(where, dev, cfg, result)
    counted = [(i, x) for i, x in xids if x not in cfg.ignore_xids]
    if len(counted) > cfg.max_xid_events:
        listed = ", ".join(f"gpu {i}: Xid {x}" if i >= 0 else f"Xid {x}" for i, x in counted[:20])
        result.fail(f"{len(counted)} Xid event(s) in {cfg.xid_window_s:g} s > {cfg.max_xid_events}: {listed}")
    result.measured["xid_window_s"] = cfg.xid_window_s
    result.measured["gpus"] = [devices[i] for i in sorted(devices)]


def _driver_version(nvml: Any) -> str | None:
    try:
        return _text(nvml.nvmlSystemGetDriverVersion())
    except Exception:
        return None
