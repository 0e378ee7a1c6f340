"""``nic`` source: Ethernet interfaces from ``/sys/class/net`` and InfiniBand ports from
``/sys/class/infiniband`` (operstate, carrier and its change count, bytes, errors, drops, IB port
state and error counters).  NIC down or flapping is the paper's first network inspection item
(§4.1, 30 s interval).  One unreadable interface or counter is left out, not fatal.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.telemetry import NicSample, NicSampleBatch
from trainguard.streams.exporter.sources.base import SourceContext, read_text, register

log = logging.getLogger(__name__)

_STATS = ("rx_bytes", "tx_bytes", "rx_errors", "tx_errors", "rx_dropped", "tx_dropped")


def parse_int(text: str) -> int | None:
    """A sysfs counter; None for anything that is not a non-negative integer.

    >>> parse_int("12\\n"), parse_int("0x1f"), parse_int("garbage"), parse_int("-1")
    (12, 31, None, None)
    """
    text = text.strip()
    try:
        value = int(text, 16) if text.lower().startswith("0x") else int(text)
    except ValueError:
        return None
    return value if 0 <= value < 2**64 else None


def parse_ib_state(text: str) -> str:
    """IB ``state``/``phys_state`` files read ``"4: ACTIVE"`` / ``"5: LinkUp"``: the name, lowered.

    >>> parse_ib_state("4: ACTIVE"), parse_ib_state("5: LinkUp"), parse_ib_state("")
    ('active', 'linkup', 'unknown')
    """
    name = text.split(":", 1)[-1].strip().lower()
    return name or "unknown"


def _read_opt(path: Path) -> str | None:
    # carrier raises EINVAL on an administratively down interface: that is "unknown", not an error.
    try:
        return read_text(path)
    except OSError:
        return None


def read_eth(dev: Path) -> NicSample:
    """One ``/sys/class/net/<dev>`` directory as a sample (missing files -> None fields)."""
    carrier_text = _read_opt(dev / "carrier")
    stats: dict[str, int | None] = {s: parse_int(_read_opt(dev / "statistics" / s) or "") for s in _STATS}
    changes = _read_opt(dev / "carrier_changes")
    return NicSample(
        name=dev.name,
        kind="eth",
        operstate=(_read_opt(dev / "operstate") or "unknown").lower() or "unknown",
        carrier=None if carrier_text is None else carrier_text.strip() == "1",
        carrier_changes=parse_int(changes) if changes is not None else None,
        rx_bytes=stats["rx_bytes"],
        tx_bytes=stats["tx_bytes"],
        rx_errors=stats["rx_errors"],
        tx_errors=stats["tx_errors"],
        rx_dropped=stats["rx_dropped"],
        tx_dropped=stats["tx_dropped"],
    )


def read_ib_port(port: Path, device: str) -> NicSample:
    """One ``/sys/class/infiniband/<dev>/ports/<n>`` directory (state + every counter file)."""
    counters: dict[str, int] = {}
    cdir = port / "counters"
    if cdir.is_dir():
        for entry in sorted(os.listdir(cdir)):
            value = parse_int(_read_opt(cdir / entry) or "")
            if value is not None:
                counters[entry] = value
    phys = _read_opt(port / "phys_state")
    rx = counters.get("port_rcv_data")
    tx = counters.get("port_xmit_data")
    return NicSample(
        name=f"{device}/{port.name}",
        kind="ib",
        operstate=parse_ib_state(_read_opt(port / "state") or ""),
        carrier=None if phys is None else parse_ib_state(phys) == "linkup",
        # port_*_data count 4-byte words (IB spec), not bytes.
        rx_bytes=None if rx is None else rx * 4,
        tx_bytes=None if tx is None else tx * 4,
        rx_errors=counters.get("port_rcv_errors"),
        tx_errors=counters.get("port_xmit_discards"),
        counters=counters,
    )


def scan(sys_class: Path, exclude: str, infiniband: bool) -> list[NicSample]:
    """Every interface under ``<root>/sys/class`` (``net`` and ``infiniband``), sorted by name."""
    skip = re.compile(exclude) if exclude else None
    out: list[NicSample] = []
    net = sys_class / "net"
    if net.is_dir():
        for name in sorted(os.listdir(net)):
            if skip is not None and skip.match(name):
                continue
            try:
                out.append(read_eth(net / name))
            except (OSError, ValueError) as exc:  # vanished mid-scan, odd values
                log.warning("nic %s: %s", name, exc)
    ib = sys_class / "infiniband"
    if infiniband and ib.is_dir():
        for dev in sorted(os.listdir(ib)):
            ports = ib / dev / "ports"
            if not ports.is_dir():
                continue
            for port in sorted(os.listdir(ports), key=lambda p: (len(p), p)):
                try:
                    out.append(read_ib_port(ports / port, dev))
                except (OSError, ValueError) as exc:
                    log.warning("infiniband %s/%s: %s", dev, port, exc)
    return out


class NicSource:
    name = "nic"

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg.nic
        self.sys_class = ctx.cfg.sys_path("/sys/class")

    def collect(self) -> list[Event]:
        if not (self.sys_class / "net").is_dir():
            raise FileNotFoundError(f"{self.sys_class / 'net'} does not exist")
        nics = scan(self.sys_class, self.cfg.exclude, self.cfg.infiniband)
        return [NicSampleBatch(node=self.ctx.node, ts_ms=now_ms(), nics=nics, job=self.ctx.job)]

    def close(self) -> None:
        pass


@register("nic")
def _factory(ctx: SourceContext) -> NicSource:
    return NicSource(ctx)
