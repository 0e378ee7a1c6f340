"""A NIC that its exporter never saw up is sampled but is no fault (#36); one that was up and
goes down still is, exactly as before -- and so is every down interface of a version 1 batch."""

from __future__ import annotations

from trainguard.detectors.node_inspector import NodeInspector
from trainguard.detectors.rule_table import match_nic_state
from trainguard.schemas.codec import decode, encode
from trainguard.schemas.control import Detection
from trainguard.schemas.enums import Action
from trainguard.schemas.telemetry import NicSample, NicSampleBatch


def _batch(ts_s: float, *nics: NicSample) -> NicSampleBatch:
    return NicSampleBatch(node="n1", ts_ms=int(ts_s * 1000), nics=list(nics), job="j")


def _downs(inspector: NodeInspector, batch: NicSampleBatch) -> list[Detection]:
    return [d for d in inspector.inspect(batch, batch.ts_ms + 1) if d.kind == "nic-state-down"]


def test_never_up_interfaces_are_no_fault_round_after_round() -> None:
    insp = NodeInspector()
    eth0 = NicSample(name="eth0", operstate="up", carrier=True, carrier_changes=2)
    spare = NicSample(name="eth1", operstate="down", carrier_changes=0, never_up=True)
    ib = NicSample(name="mlx5_1/1", kind="ib", operstate="down", carrier=False, never_up=True)
    # ten rounds 30 s apart: the rule's 2-in-300 s would have evicted on the second
    for i in range(10):
        assert _downs(insp, _batch(30.0 * i, eth0, spare, ib)) == []


def test_up_then_down_is_a_fault_as_before() -> None:
    insp = NodeInspector()
    eth0 = NicSample(name="eth0", operstate="up", carrier=True, carrier_changes=2)
    assert _downs(insp, _batch(0, eth0)) == []
    down = NicSample(name="eth0", operstate="down", carrier_changes=3)
    first, second = _downs(insp, _batch(30, down)), _downs(insp, _batch(60, down))
    assert [d.action for d in first] == [Action.IGNORE]  # tolerated once (links self-heal)
    assert [d.action for d in second] == [Action.EVICT]
    assert (second[0].evidence["interface"], second[0].evidence["never_up"]) == ("eth0", 0)


def test_version_1_batches_read_as_interfaces_that_were_up() -> None:
    raw = (
        b'{"schema":"nic_batch","version":1,"node":"n1","ts_ms":30000,"job":"j",'
        b'"nics":[{"name":"ib0","kind":"eth","operstate":"down","carrier":false}]}'
    )
    v1 = decode(raw)
    assert isinstance(v1, NicSampleBatch) and v1.nics[0].never_up is False
    insp = NodeInspector()
    assert [d.action for d in _downs(insp, v1)] == [Action.IGNORE]
    later = NicSampleBatch(node="n1", ts_ms=60_000, nics=v1.nics, job="j")
    assert [d.action for d in _downs(insp, later)] == [Action.EVICT]
    assert decode(encode(later)) == later  # and version 2 carries never_up both ways


def test_the_row_itself_skips_never_up_but_not_a_flap() -> None:
    down = {"interface": "eth1", "operstate": "down", "carrier": 0}
    assert [m.rule.id for m in match_nic_state(down)] == ["nic-state-down"]
    assert match_nic_state({**down, "never_up": 1}) == []
    assert match_nic_state({**down, "never_up": True}) == []
    # a carrier that went down and up between samples was up: flapping stays a fault
    flap = {
        "interface": "eth1",
        "operstate": "up",
        "carrier": 1,
        "carrier_changes": 9,
        "carrier_changes_prev": 5,
    }
    assert [m.rule.id for m in match_nic_state({**flap, "never_up": 1})] == ["nic-carrier-flap"]
