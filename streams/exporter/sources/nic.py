"""``nic`` source: the interfaces that can carry training traffic -- physical interfaces of
``/sys/class/net`` and the InfiniBand/RoCE ports of ``/sys/class/infiniband`` -- with operstate,
carrier and its change count, bytes, errors, drops, IB port state and error counters.  NIC down
or flapping is the paper's first network inspection item (§4.1, 30 s interval).

Which interfaces is decided from sysfs facts, not names (:func:`eth_choice`, :func:`ib_choice`):
an interface with a ``device`` link has hardware behind it and is watched; the host's virtual
ones (loopback, bridges, veth, ifb, tun/tap, dummy, bond masters) are not -- healthy hosts keep
some administratively down, and a NIC-down alert on each would evict healthy machines.  NCCL's
``NCCL_SOCKET_IFNAME``/``NCCL_IB_HCA`` (:func:`parse_nccl_list`) and the config's ``include`` and
``exclude`` adjust the choice; the heartbeat says what was watched and what skipped, with why.

An interface not up since the exporter started (this boot: the record of the interfaces seen up
survives restarts in the state directory) is sampled with ``never_up`` set, and the rule table
does not take its being down for a fault (a port never cabled, one left unused); once seen up,
its going down is one.  One unreadable interface or counter is left out, not fatal.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainguard.schemas.base import Event, now_ms
from trainguard.schemas.telemetry import NicSample, NicSampleBatch
from trainguard.streams.exporter.config import NicConfig
from trainguard.streams.exporter.sources.base import SourceContext, Watching, read_text, register

log = logging.getLogger(__name__)

_STATS = ("rx_bytes", "tx_bytes", "rx_errors", "tx_errors", "rx_dropped", "tx_dropped")
#: ``/sys/class/net/<if>/type`` of a loopback interface (include/uapi/linux/if_arp.h).
ARPHRD_LOOPBACK = 772
#: where the interfaces seen up are kept between restarts (in the exporter's state directory).
SEEN_UP_FILE = "nic.seen_up.json"


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


# -- which interfaces -----------------------------------------------------------------------------


@dataclass(frozen=True)
class NcclList:
    """An ``NCCL_SOCKET_IFNAME`` / ``NCCL_IB_HCA`` value as NCCL reads it (``parseStringList`` and
    ``matchIfList``): comma-separated name prefixes; exact names after a leading ``=``; the
    complement after a leading ``^`` (``^=`` for both); each entry optionally ``:port``.

    >>> hca = parse_nccl_list("^=mlx5_4:1,mlx5_5")
    >>> hca.exclude, hca.exact, hca.entries
    (True, True, (('mlx5_4', 1), ('mlx5_5', None)))
    >>> [parse_nccl_list("eth").names(n) for n in ("eth0", "eth1.100", "ens1")]
    [True, True, False]
    >>> parse_nccl_list("=eth0").names("eth01"), parse_nccl_list("mlx5_0:1").names("mlx5_0", 2)
    (False, False)
    """

    exclude: bool = False
    exact: bool = False
    entries: tuple[tuple[str, int | None], ...] = ()

    def names(self, name: str, port: int | None = None) -> bool:
        """Whether an entry names ``name`` (and ``port``, where both have one)."""
        for prefix, entry_port in self.entries:
            hit = name == prefix if self.exact else name.startswith(prefix)
            if hit and (entry_port is None or port is None or entry_port == port):
                return True
        return False


def parse_nccl_list(text: str) -> NcclList:
    """Parse an NCCL interface/HCA list (see :class:`NcclList`); "" names nothing."""
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    entries: list[tuple[str, int | None]] = []
    for item in text.split(","):
        name, sep, port = item.strip().partition(":")
        if not name:
            continue  # NCCL skips empty entries ("eth0,,eth1", a trailing comma)
        # NCCL reads the port with atoi: anything but digits is port 0, which names no port.
        entries.append((name, (int(port) if port.isdigit() else 0) if sep else None))
    return NcclList(exclude=exclude, exact=exact, entries=tuple(entries))


@dataclass(frozen=True)
class Selection:
    """The ``nic`` config resolved: NCCL's variables read, expressions compiled."""

    exclude: re.Pattern[str] | None = None
    include: re.Pattern[str] | None = None
    socket_ifname: NcclList = field(default_factory=NcclList)
    ib_hca: NcclList = field(default_factory=NcclList)
    infiniband: bool = True

    @classmethod
    def from_config(cls, cfg: NicConfig, environ: Mapping[str, str]) -> Selection:
        """``cfg``, with NCCL's variables taken from ``environ`` where it leaves them unset (None)."""
        sock = environ.get("NCCL_SOCKET_IFNAME", "") if cfg.socket_ifname is None else cfg.socket_ifname
        hca = environ.get("NCCL_IB_HCA", "") if cfg.ib_hca is None else cfg.ib_hca
        return cls(
            exclude=re.compile(cfg.exclude) if cfg.exclude else None,
            include=re.compile(cfg.include) if cfg.include else None,
            socket_ifname=parse_nccl_list(sock),
            ib_hca=parse_nccl_list(hca),
            infiniband=cfg.infiniband,
        )


def _uevent(dev: Path) -> dict[str, str]:
    text = _read_opt(dev / "uevent") or ""
    return dict(line.partition("=")[::2] for line in text.splitlines() if "=" in line)


def virtual_kind(dev: Path) -> str | None:
    """None for a physical interface of ``/sys/class/net`` (a ``device`` link: a PCI, USB, ...
    device behind it; bonding slaves and SR-IOV functions included); else what sysfs says it is:
    ``loopback`` (``type``), ``bridge`` (a ``bridge`` directory), ``tun/tap`` (``tun_flags``),
    ``bond`` (a bonding master), the uevent ``DEVTYPE`` (vlan, vxlan, macvlan, ...), or
    ``no device link`` (veth, ifb, dummy: nothing else tells them apart)."""
    if (dev / "device").exists():
        return None
    if parse_int(_read_opt(dev / "type") or "") == ARPHRD_LOOPBACK:
        return "loopback"
    if (dev / "bridge").is_dir():
        return "bridge"
    if (dev / "tun_flags").exists():
        return "tun/tap"
    if (dev / "bonding").is_dir():
        return "bond"
    return _uevent(dev).get("DEVTYPE", "").strip()[:64] or "no device link"


def eth_choice(dev: Path, sel: Selection) -> tuple[bool, str]:
    """(watched, why) for ``/sys/class/net/<name>``: ``exclude``, then ``include``, then what
    NCCL_SOCKET_IFNAME names (watched, or skipped after ``^``), then the sysfs facts.  A physical
    interface NCCL_SOCKET_IFNAME does not name stays watched: RDMA NICs carry training traffic
    without being named there."""
    name = dev.name
    if sel.exclude is not None and sel.exclude.match(name):
        return False, "nic.exclude"
    if sel.include is not None and sel.include.match(name):
        return True, "nic.include"
    if sel.socket_ifname.names(name):
        if sel.socket_ifname.exclude:
            return False, "excluded by NCCL_SOCKET_IFNAME"
        return True, "named by NCCL_SOCKET_IFNAME"
    kind = virtual_kind(dev)
    return (True, "physical") if kind is None else (False, f"virtual: {kind}")


def ib_choice(device: str, port: str, sel: Selection) -> tuple[bool, str]:
    """(watched, why) for port ``port`` of HCA ``device``: every RDMA port, unless ``infiniband``
    is off, ``exclude`` names it, or NCCL_IB_HCA leaves it out (``include`` overrides that)."""
    name = f"{device}/{port}"
    if not sel.infiniband:
        return False, "nic.infiniband: false"
    if sel.exclude is not None and sel.exclude.match(name):
        return False, "nic.exclude"
    if sel.include is not None and sel.include.match(name):
        return True, "nic.include"
    hca = sel.ib_hca
    if hca.entries:
        named = hca.names(device, int(port) if port.isdigit() else None)
        if hca.exclude and named:
            return False, "excluded by NCCL_IB_HCA"
        if not hca.exclude and not named:
            return False, "not in NCCL_IB_HCA"
        if named:
            return True, "named by NCCL_IB_HCA"
    return True, "rdma port"


# -- reading --------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Scan:
    """One round: the samples of the watched interfaces, and the skipped ones with why."""

    samples: list[NicSample]
    skipped: list[tuple[str, str]]


def scan(sys_class: Path, sel: Selection | None = None) -> Scan:
    """The interfaces under ``<root>/sys/class`` (``net`` and ``infiniband``) that ``sel`` watches
    (default: the ``nic`` defaults without NCCL variables), each group sorted by name."""
    sel = sel or Selection()
    out: list[NicSample] = []
    skipped: list[tuple[str, str]] = []
    net = sys_class / "net"
    if net.is_dir():
        for name in sorted(os.listdir(net)):
            try:
                watched, why = eth_choice(net / name, sel)
                if not watched:
                    skipped.append((name, why))
                    continue
                out.append(read_eth(net / name))
            except (OSError, ValueError) as exc:  # vanished mid-scan, odd values
                log.warning("nic %s: %s", name, exc)
                skipped.append((name, f"unreadable: {type(exc).__name__}"))
    ib = sys_class / "infiniband"
    if ib.is_dir():
        for dev in sorted(os.listdir(ib)):
            ports = ib / dev / "ports"
            if not ports.is_dir():
                continue
            for port in sorted(os.listdir(ports), key=lambda p: (len(p), p)):
                watched, why = ib_choice(dev, port, sel)
                if not watched:
                    skipped.append((f"{dev}/{port}", why))
                    continue
                try:
                    out.append(read_ib_port(ports / port, dev))
                except (OSError, ValueError) as exc:
                    log.warning("infiniband %s/%s: %s", dev, port, exc)
                    skipped.append((f"{dev}/{port}", f"unreadable: {type(exc).__name__}"))
    return Scan(out, sorted(skipped))


# -- never up -------------------------------------------------------------------------------------


def is_up(s: NicSample) -> bool:
    """Whether a sample shows its interface up: an IB port ``active``; an Ethernet one ``up``, or
    ``unknown`` with a carrier (drivers that report no operstate)."""
    if s.kind == "ib":
        return s.operstate == "active"
    return s.operstate == "up" or (s.operstate == "unknown" and s.carrier is True)


def mark_never_up(samples: Iterable[NicSample], seen_up: set[str]) -> list[NicSample]:
    """``samples`` with ``never_up`` set on those neither up now nor in ``seen_up``; the ones up
    now are added to ``seen_up``.

    >>> seen: set[str] = set()
    >>> down, up = NicSample(name="eth1", operstate="down"), NicSample(name="eth0", operstate="up")
    >>> [(s.name, s.never_up) for s in mark_never_up([up, down], seen)], sorted(seen)
    ([('eth0', False), ('eth1', True)], ['eth0'])
    >>> [s.never_up for s in mark_never_up([replace(up, operstate="down")], seen)]  # went down
    [False]
    """
    out = []
    for s in samples:
        if is_up(s):
            seen_up.add(s.name)
        out.append(s if s.name in seen_up else replace(s, never_up=True))
    return out


class NicSource:
    name = "nic"

    def __init__(self, ctx: SourceContext, environ: Mapping[str, str] | None = None) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg.nic
        self.sys_class = ctx.cfg.sys_path("/sys/class")
        self.selection = Selection.from_config(self.cfg, os.environ if environ is None else environ)
        self.seen_file = None if ctx.once or ctx.state_dir is None else ctx.state_dir / SEEN_UP_FILE
        self.boot_id = _read_opt(ctx.cfg.sys_path("/proc/sys/kernel/random/boot_id")) or ""
        self.seen_up = self._load_seen_up()
        self._saved_up = frozenset(self.seen_up)
        self._watching: Watching | None = None

    def _load_seen_up(self) -> set[str]:
        if self.seen_file is None or not self.seen_file.exists():
            return set()
        try:
            data = json.loads(self.seen_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log.warning("unreadable %s (%s): every down interface counts as never up", self.seen_file, exc)
            return set()
        # Another boot: an interface up then is not known to have been up since.
        if not isinstance(data, dict) or data.get("boot_id") != self.boot_id:
            return set()
        names = data.get("up")
        if not isinstance(names, list):
            return set()
        return {n for n in names if isinstance(n, str)}

    def collect(self) -> list[Event]:
        if not (self.sys_class / "net").is_dir():
            raise FileNotFoundError(f"{self.sys_class / 'net'} does not exist")
        result = scan(self.sys_class, self.selection)
        nics = mark_never_up(result.samples, self.seen_up)
        watching = Watching(tuple(sorted(s.name for s in nics)), tuple(result.skipped))
        if self._watching is None or watching.watched != self._watching.watched:
            log.info(
                "nic: watching %s; %d skipped (see the heartbeat)",
                ", ".join(watching.watched) or "no interface",
                len(watching.skipped),
            )
        self._watching = self.ctx.watching[self.name] = watching
        return [NicSampleBatch(node=self.ctx.node, ts_ms=now_ms(), nics=nics, job=self.ctx.job)]

    def commit(self) -> None:
        """Persist the interfaces seen up once the round is spooled (only when there is news)."""
        if self.seen_file is None or self.seen_up == self._saved_up:
            return
        tmp = self.seen_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"boot_id": self.boot_id, "up": sorted(self.seen_up)}), encoding="utf-8")
        os.replace(tmp, self.seen_file)
        self._saved_up = frozenset(self.seen_up)

    def close(self) -> None:
        pass


@register("nic")
def _factory(ctx: SourceContext) -> NicSource:
    return NicSource(ctx)
