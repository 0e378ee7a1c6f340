"""Which interfaces the ``nic`` source watches (#36).

A user trial drained 4 of 5 healthy nodes in 40 s: every host had two administratively down
``ifb`` interfaces, the exporter reported them as NICs down and each became an eviction.  These
tests build sysfs trees under ``tmp_path`` -- the ``eth0``/``ifb0``/``ifb1``/``lo`` files hold what a
real host with exactly that trouble reads (a VM: virtio ``eth0``, two ``ifb`` down, carrier
unreadable on them) -- and check the choice (sysfs facts, NCCL's variables, include/exclude),
the never-up marking, the heartbeat, and the node inspector's verdict end to end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.exporter.conftest import make_cfg
from trainguard.detectors.node_inspector import NodeInspector
from trainguard.schemas.codec import decode, encode
from trainguard.schemas.config import ConfigError
from trainguard.schemas.telemetry import Heartbeat, NicSampleBatch, SkippedNic
from trainguard.streams.exporter.config import NicConfig, load_exporter_config
from trainguard.streams.exporter.runner import Exporter
from trainguard.streams.exporter.sources import nic
from trainguard.streams.exporter.sources.base import SourceContext

BOOT = "ff25b5be-0596-4f78-ace8-fab08458020f"


def _iface(
    root: Path,
    name: str,
    *,
    operstate: str,
    carrier: str | None = None,
    carrier_changes: int = 0,
    arphrd: int = 1,
    pci: str | None = None,
    devtype: str | None = None,
    ifindex: int = 2,
    dirs: tuple[str, ...] = (),
    files: dict[str, str] | None = None,
) -> Path:
    """One ``/sys/class/net/<name>`` directory; ``pci``: a physical one (a ``device`` link)."""
    dev = root / "sys/class/net" / name
    (dev / "statistics").mkdir(parents=True)
    uevent = f"INTERFACE={name}\nIFINDEX={ifindex}\n" + (f"DEVTYPE={devtype}\n" if devtype else "")
    values = {"operstate": operstate, "carrier_changes": str(carrier_changes), "type": str(arphrd)}
    values |= {"uevent": uevent, **(files or {})}
    if carrier is not None:  # an administratively down interface refuses to tell (EINVAL)
        values["carrier"] = carrier
    for key, value in values.items():
        (dev / key).write_text(value + "\n")
    for stat in ("rx_bytes", "tx_bytes", "rx_errors", "tx_errors", "rx_dropped", "tx_dropped"):
        (dev / "statistics" / stat).write_text("0\n")
    for sub in dirs:
        (dev / sub).mkdir()
    if pci is not None:
        target = root / "sys/devices/pci0000:00" / pci
        target.mkdir(parents=True, exist_ok=True)
        (dev / "device").symlink_to(Path("../../../devices/pci0000:00") / pci)
    return dev


def _ib_port(root: Path, hca: str, port: int, state: str) -> Path:
    p = root / "sys/class/infiniband" / hca / "ports" / str(port)
    (p / "counters").mkdir(parents=True)
    active = state == "ACTIVE"
    (p / "state").write_text(("4: ACTIVE" if active else "1: DOWN") + "\n")
    (p / "phys_state").write_text(("5: LinkUp" if active else "3: Disabled") + "\n")
    (p / "counters" / "link_downed").write_text("0\n")
    return p


def machine(tmp_path: Path) -> Path:
    """A GPU node's sysfs: the physical and RDMA interfaces training uses, and the host's
    virtual ones, several of them down."""
    root = tmp_path / "root"
    _iface(root, "eth0", operstate="up", carrier="1", carrier_changes=2, pci="0000:00:03.0", ifindex=4)
    _iface(root, "eth1", operstate="up", carrier="1", carrier_changes=2, pci="0000:00:04.0", ifindex=5)
    _iface(root, "ifb0", operstate="down", ifindex=2)
    _iface(root, "ifb1", operstate="down", ifindex=3)
    _iface(root, "lo", operstate="unknown", carrier="1", arphrd=772, ifindex=1)
    _iface(root, "veth5f3a2c1", operstate="up", carrier="1", files={"iflink": "11"}, ifindex=12)
    _iface(root, "br0", operstate="down", devtype="bridge", dirs=("bridge",), ifindex=6)
    _iface(root, "docker0", operstate="down", devtype="bridge", dirs=("bridge",), ifindex=7)
    _iface(root, "dummy0", operstate="down", ifindex=8)
    _iface(
        root, "tun0", operstate="unknown", carrier="1", arphrd=65534, files={"tun_flags": "0x1001"}, ifindex=9
    )
    _iface(root, "bond0", operstate="down", devtype="bond", dirs=("bonding",), ifindex=10)
    _iface(root, "eth0.100", operstate="up", carrier="1", devtype="vlan", ifindex=13)
    _ib_port(root, "mlx5_0", 1, "ACTIVE")
    _ib_port(root, "mlx5_1", 1, "ACTIVE")
    (root / "proc/sys/kernel/random").mkdir(parents=True)
    (root / "proc/sys/kernel/random/boot_id").write_text(BOOT + "\n")
    return root


def _scan(root: Path, environ: dict[str, str] | None = None, **cfg: Any) -> nic.Scan:
    sel = nic.Selection.from_config(NicConfig(**cfg), environ={} if environ is None else environ)
    return nic.scan(root / "sys/class", sel)


def _watched(result: nic.Scan) -> list[str]:
    return [s.name for s in result.samples]


# -- the choice -------------------------------------------------------------------------------------


def test_default_watches_physical_interfaces_and_rdma_ports_only(tmp_path: Path) -> None:
    result = _scan(machine(tmp_path))
    assert _watched(result) == ["eth0", "eth1", "mlx5_0/1", "mlx5_1/1"]
    assert dict(result.skipped) == {
        "bond0": "virtual: bond",
        "br0": "virtual: bridge",
        "docker0": "virtual: bridge",
        "dummy0": "virtual: no device link",
        "eth0.100": "virtual: vlan",
        "ifb0": "virtual: no device link",
        "ifb1": "virtual: no device link",
        "lo": "virtual: loopback",
        "tun0": "virtual: tun/tap",
        "veth5f3a2c1": "virtual: no device link",
    }


def test_facts_not_names_decide(tmp_path: Path) -> None:
    root = tmp_path / "root"
    # a physical port that happens to be named like a virtual one, and a veth named like a NIC
    _iface(root, "ifb-uplink", operstate="up", carrier="1", pci="0000:17:00.0")
    _iface(root, "ens1f0np0", operstate="up", carrier="1")
    assert _watched(_scan(root)) == ["ifb-uplink"]
    assert _scan(root).skipped == [("ens1f0np0", "virtual: no device link")]


@pytest.mark.parametrize(
    ("ifname", "added", "removed"),
    [
        # a prefix: every interface starting with it, virtual ones included (the vlan)
        ("eth", {"eth0.100": "named by NCCL_SOCKET_IFNAME"}, {}),
        # an exclusion list: NCCL uses none of them
        (
            "^docker,lo",
            {},
            {"docker0": "excluded by NCCL_SOCKET_IFNAME", "lo": "excluded by NCCL_SOCKET_IFNAME"},
        ),
        # exact names: eth0 only (not eth0.100); eth1 stays watched, it is physical
        ("=eth0", {}, {}),
        ("bond0", {"bond0": "named by NCCL_SOCKET_IFNAME"}, {}),
        ("^=eth1", {}, {"eth1": "excluded by NCCL_SOCKET_IFNAME"}),
    ],
)
def test_nccl_socket_ifname(
    tmp_path: Path, ifname: str, added: dict[str, str], removed: dict[str, str]
) -> None:
    root = machine(tmp_path)
    default = _scan(root)
    result = _scan(root, {"NCCL_SOCKET_IFNAME": ifname})
    assert set(_watched(result)) == (set(_watched(default)) | set(added)) - set(removed)
    skipped = dict(result.skipped)
    assert all(skipped[name] == why for name, why in removed.items())
    assert all(name not in skipped for name in added)
    # the config key says the same and wins over the exporter's environment
    assert _watched(_scan(root, {"NCCL_SOCKET_IFNAME": "nothing"}, socket_ifname=ifname)) == _watched(result)


def test_nccl_socket_ifname_exact_is_exact(tmp_path: Path) -> None:
    root = machine(tmp_path)
    skipped = dict(_scan(root, {"NCCL_SOCKET_IFNAME": "=eth0"}).skipped)
    assert skipped["eth0.100"] == "virtual: vlan"  # "=eth0" does not name it; "eth0" would
    assert "eth0.100" in _watched(_scan(root, {"NCCL_SOCKET_IFNAME": "eth0"}))


@pytest.mark.parametrize(
    ("hca", "watched", "why"),
    [
        ("mlx5_0", ["mlx5_0/1"], {"mlx5_1/1": "not in NCCL_IB_HCA"}),
        ("=mlx5_1:1", ["mlx5_1/1"], {"mlx5_0/1": "not in NCCL_IB_HCA"}),
        ("mlx5", ["mlx5_0/1", "mlx5_1/1"], {}),
        ("mlx5_0:2,mlx5_1", ["mlx5_1/1"], {"mlx5_0/1": "not in NCCL_IB_HCA"}),  # port 2: not port 1
        ("^mlx5_1", ["mlx5_0/1"], {"mlx5_1/1": "excluded by NCCL_IB_HCA"}),
        ("", ["mlx5_0/1", "mlx5_1/1"], {}),
    ],
)
def test_nccl_ib_hca(tmp_path: Path, hca: str, watched: list[str], why: dict[str, str]) -> None:
    result = _scan(machine(tmp_path), {"NCCL_IB_HCA": hca})
    assert [n for n in _watched(result) if "/" in n] == watched
    assert {n: w for n, w in result.skipped if "/" in n} == why
    assert all(s.kind == "ib" for s in result.samples if "/" in s.name)


def test_include_and_exclude(tmp_path: Path) -> None:
    root = machine(tmp_path)
    result = _scan(root, include=r"bond0$|ifb0$", exclude=r"eth1$|ifb0$")
    # include watches virtual interfaces; exclude wins over everything, physical ones included
    assert _watched(result) == ["bond0", "eth0", "mlx5_0/1", "mlx5_1/1"]
    assert dict(result.skipped)["eth1"] == dict(result.skipped)["ifb0"] == "nic.exclude"
    # on RDMA ports too (named <hca>/<port>), and include overrides NCCL_IB_HCA
    result = _scan(root, {"NCCL_IB_HCA": "mlx5_0"}, include=r"mlx5_1/1", exclude=r"mlx5_0/")
    assert [n for n in _watched(result) if "/" in n] == ["mlx5_1/1"]
    assert dict(result.skipped)["mlx5_0/1"] == "nic.exclude"
    assert dict(_scan(root, infiniband=False).skipped)["mlx5_0/1"] == "nic.infiniband: false"


def test_config_keys_are_checked(tmp_path: Path) -> None:
    cfg = load_exporter_config(
        {"nic": {"include": "bond0$"}}, environ={"TRAINGUARD_EXPORTER__NIC__SOCKET_IFNAME": "^docker,lo"}
    )
    assert (cfg.nic.include, cfg.nic.socket_ifname, cfg.nic.ib_hca) == ("bond0$", "^docker,lo", None)
    with pytest.raises(ConfigError, match="exclude"):
        load_exporter_config({"nic": {"exclude": "(eth"}}, environ={})
    with pytest.raises(ConfigError, match="max_listed"):
        load_exporter_config({"nic": {"max_listed": 100_000}}, environ={})
    assert NicConfig().exclude == ""  # the sysfs facts do what the old name list did


# -- never up ---------------------------------------------------------------------------------------


def _source(root: Path, state: Path | None, **nic_cfg: object) -> nic.NicSource:
    cfg = make_cfg(root, state or root / "unused", nic=nic_cfg)
    if state is not None:
        state.mkdir(parents=True, exist_ok=True)  # the runner makes it
    return nic.NicSource(SourceContext(cfg, state_dir=state, once=state is None), environ={})


def _round(src: nic.NicSource) -> dict[str, bool]:
    (batch,) = src.collect()
    src.commit()
    assert isinstance(batch, NicSampleBatch)
    return {s.name: s.never_up for s in batch.nics}


def _set(root: Path, name: str, operstate: str, carrier: str | None) -> None:
    dev = root / "sys/class/net" / name
    (dev / "operstate").write_text(operstate + "\n")
    (dev / "carrier").unlink(missing_ok=True)
    if carrier is not None:
        (dev / "carrier").write_text(carrier + "\n")


def test_never_up_versus_went_down(tmp_path: Path) -> None:
    root = machine(tmp_path)
    _set(root, "eth1", "down", None)  # a port never cabled
    (root / "sys/class/infiniband/mlx5_1/ports/1/state").write_text("1: DOWN\n")
    src = _source(root, tmp_path / "state", include="ifb")
    first = _round(src)
    # the ifbs are watched here (include) but never up: sampled, marked
    assert first == {
        "eth0": False,
        "eth1": True,
        "ifb0": True,
        "ifb1": True,
        "mlx5_0/1": False,
        "mlx5_1/1": True,
    }
    _set(root, "eth0", "down", None)  # was up: a fault, exactly as before
    assert _round(src)["eth0"] is False
    _set(root, "eth1", "up", "1")  # cabled at last ...
    assert _round(src)["eth1"] is False
    _set(root, "eth1", "down", "0")  # ... so its going down now counts
    assert _round(src)["eth1"] is False
    (root / "sys/class/infiniband/mlx5_1/ports/1/state").write_text("4: ACTIVE\n")
    _round(src)
    (root / "sys/class/infiniband/mlx5_1/ports/1/state").write_text("1: DOWN\n")
    assert _round(src)["mlx5_1/1"] is False


def test_seen_up_survives_a_restart_on_the_same_boot_only(tmp_path: Path) -> None:
    root, state = machine(tmp_path), tmp_path / "state"
    _round(_source(root, state))  # eth0 up
    saved = json.loads((state / nic.SEEN_UP_FILE).read_text())
    assert saved == {"boot_id": BOOT, "up": ["eth0", "eth1", "mlx5_0/1", "mlx5_1/1"]}
    _set(root, "eth0", "down", None)
    # the exporter restarted during the outage: eth0 is still one that went down
    assert _round(_source(root, state))["eth0"] is False
    # after a reboot, nothing is known to have been up since
    (root / "proc/sys/kernel/random/boot_id").write_text("0b5e6a55-1d3c-4e0f-9a2b-7c8d9e0f1a2b\n")
    assert _round(_source(root, state))["eth0"] is True
    # a damaged record is a warning and a fresh start, not a crash
    (state / nic.SEEN_UP_FILE).write_text("{not json")
    assert _round(_source(root, state))["eth0"] is True


def test_once_writes_no_state(tmp_path: Path) -> None:
    root = machine(tmp_path)
    src = _source(root, None)
    assert _round(src)["eth0"] is False
    assert not (root / "unused").exists()


# -- the heartbeat ----------------------------------------------------------------------------------


def _one_round(root: Path, state: Path, **nic_cfg: object) -> list[object]:
    # (NCCL's variables are cleared for every exporter test: conftest.py)
    cfg = make_cfg(root, state, nic=nic_cfg, process={"enabled": False}, kernel_log={"enabled": False})
    ex = Exporter(cfg, lambda e: None, once=True)
    events = ex.run_once()
    ex.stop()
    return events


def test_heartbeat_says_what_is_watched_and_what_skipped(tmp_path: Path) -> None:
    events = _one_round(machine(tmp_path), tmp_path / "state")
    hb = events[-1]
    assert isinstance(hb, Heartbeat)
    assert hb.nics_watched == ["eth0", "eth1", "mlx5_0/1", "mlx5_1/1"] and hb.nics_watched_total == 4
    assert hb.nics_skipped_total == 10
    assert SkippedNic("ifb0", "virtual: no device link") in hb.nics_skipped
    assert SkippedNic("lo", "virtual: loopback") in hb.nics_skipped
    assert decode(encode(hb)) == hb
    # the lists are bounded; the totals still count everything
    hb = _one_round(machine(tmp_path / "b"), tmp_path / "state-b", max_listed=2)[-1]
    assert isinstance(hb, Heartbeat)
    assert hb.nics_watched == ["eth0", "eth1"] and hb.nics_watched_total == 4
    assert [s.name for s in hb.nics_skipped] == ["bond0", "br0"] and hb.nics_skipped_total == 10


def test_heartbeat_without_a_nic_round_names_nothing(tmp_path: Path) -> None:
    hb = _one_round(machine(tmp_path), tmp_path / "state", enabled=False)[-1]
    assert isinstance(hb, Heartbeat)
    assert (hb.nics_watched, hb.nics_watched_total, hb.nics_skipped, hb.nics_skipped_total) == ([], 0, [], 0)


def test_version_1_heartbeats_still_decode() -> None:
    raw = b'{"schema":"heartbeat","version":1,"node":"n1","component":"exporter","ts_ms":1,"seq":3}'
    hb = decode(raw)
    assert isinstance(hb, Heartbeat) and hb.seq == 3 and hb.nics_watched == [] and hb.nics_skipped_total == 0


# -- end to end: the trial's machine ----------------------------------------------------------------


def test_ifb_down_is_no_nic_fault_a_physical_port_down_is(tmp_path: Path) -> None:
    """The trial's node (only ifb0/ifb1 down): no NIC-down detection, round after round -- even
    with the ifbs watched on purpose; eth0 losing its link: tolerated once, then evict."""
    root = machine(tmp_path)
    for nic_cfg in ({}, {"include": "ifb"}):
        src, insp = _source(root, tmp_path / f"state{len(nic_cfg)}", **nic_cfg), NodeInspector()
        for i in range(10):  # 10 rounds 30 s apart; the rule's 2-in-300 s evicted on the second
            (batch,) = src.collect()
            assert isinstance(batch, NicSampleBatch)
            ts = 1_000_000 + 30_000 * i
            batch = NicSampleBatch(node=batch.node, ts_ms=ts, nics=batch.nics, job=batch.job)
            assert [d for d in insp.inspect(batch, ts) if d.kind == "nic-state-down"] == []
    _set(root, "eth0", "down", None)
    actions = []
    for i in range(10, 12):
        (batch,) = src.collect()
        assert isinstance(batch, NicSampleBatch)
        ts = 1_000_000 + 30_000 * i
        batch = NicSampleBatch(node=batch.node, ts_ms=ts, nics=batch.nics, job=batch.job)
        dets = [d for d in insp.inspect(batch, ts) if d.kind == "nic-state-down"]
        assert [d.evidence["interface"] for d in dets] == ["eth0"]
        actions += [d.action.value for d in dets]
    assert actions == ["ignore", "evict"]


def test_the_demo_machines_nic_is_watched_and_its_injected_fault_seen(tmp_path: Path) -> None:
    """The demo's machines carry one simulated NIC; `trainguard inject ... nic-down` must stay a
    NIC-down the workers act on (its sysfs tree gives the NIC a device link, like a real one)."""
    from trainguard_demo.inject import NIC, inject, prepare_machine_root

    root = prepare_machine_root(tmp_path, "m1")
    prepare_machine_root(tmp_path, "m1")  # the launcher prepares a machine again on every run
    src, insp = _source(root, tmp_path / "state"), NodeInspector()
    actions = []
    for i in range(3):
        (batch,) = src.collect()
        assert isinstance(batch, NicSampleBatch) and [n.name for n in batch.nics] == [NIC]
        ts = 1_000_000 + 30_000 * i
        batch = NicSampleBatch(node="m1", ts_ms=ts, nics=batch.nics, job="j")
        actions += [d.action.value for d in insp.inspect(batch, ts) if d.kind == "nic-state-down"]
        if i == 0:
            inject(tmp_path, "m1", "nic-down")
    assert actions == ["ignore", "evict"]
