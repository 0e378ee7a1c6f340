"""The spool drops by priority under its bound: a kernel line outlives a flood (issue #38).

During a broker outage the exporter keeps spooling; the bound then drops segments.  Once it drops
the oldest whatever they held, a rank printing in a loop pushed out the Xid line spooled before
the flood.  Now ordinary records go first, lines a rule matches next, the kernel's own last.
Fast: no broker (an exporter whose delivery never runs is one whose broker is away).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainguard.infra.config import KafkaConfig
from trainguard.schemas.codec import decode
from trainguard.schemas.workload import LogLine, ProcessExit, TrainingStep
from trainguard.streams.exporter.delivery import Delivery, SpoolPriority
from trainguard.streams.exporter.sources.reporter import Rejected, accept
from trainguard.streams.exporter.spool import KERNEL, MATCHED, ORDINARY, Record, Spool, encode_frame

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
NODE, JOB = "gpu-07", "llm"


def drain(sp: Spool) -> list[bytes]:
    out = []
    sp.seal()
    while (path := sp.oldest()) is not None:
        out += [r.value for r in sp.read(path)]
        sp.remove(path)
    return out


def rec(tag: str, size: int = 100) -> Record:
    return Record("t", b"k", tag.encode().ljust(size, b"."))


FRAME = len(encode_frame(rec("x")))


def test_a_kernel_record_outlives_a_flood_of_ordinary_ones(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=FRAME * 40, segment_bytes=FRAME * 4, fsync_interval_s=None)
    sp.append(rec("xid"), KERNEL)
    for i in range(10_000):
        sp.append(rec(f"o{i:05d}"))
        if i % 7 == 0:
            sp.seal()  # a delivery thread sealing while the broker does not answer
    kept = drain(sp)
    assert kept[0].startswith(b"xid")  # the oldest record, still there
    ordinary = [v[:6] for v in kept[1:]]
    assert ordinary == sorted(ordinary) and ordinary[-1] == b"o09999"  # the newest ordinary ones
    assert sp.dropped_by_priority == {ORDINARY: 10_000 - len(ordinary), MATCHED: 0, KERNEL: 0}


def test_lower_priorities_go_first_then_the_oldest_of_the_highest(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=FRAME * 6, segment_bytes=FRAME * 2, fsync_interval_s=None)
    for i in range(4):
        sp.append(rec(f"k{i}"), KERNEL)
    for i in range(4):
        sp.append(rec(f"m{i}"), MATCHED)
    assert sp.dropped_by_priority[KERNEL] == 0 and sp.dropped_by_priority[MATCHED] > 0
    for i in range(4, 8):
        sp.append(rec(f"k{i}"), KERNEL)
    kept = [v.rstrip(b".") for v in drain(sp)]
    assert all(v.startswith(b"k") for v in kept)  # every matched line went before a kernel one
    assert kept == [f"k{i}".encode() for i in range(8 - len(kept), 8)]  # then the oldest kernel ones


def test_an_open_segment_of_a_lower_priority_goes_before_a_sealed_higher_one(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=FRAME * 5, segment_bytes=FRAME * 100, fsync_interval_s=None)
    sp.append(rec("xid"), KERNEL)
    sp.seal()
    for i in range(6):
        sp.append(rec(f"o{i}"))  # one open segment, never full: at the sixth frame it goes
    assert [v[:3] for v in drain(sp)] == [b"xid", b"o5."]
    assert sp.dropped_by_priority == {ORDINARY: 5, MATCHED: 0, KERNEL: 0}


def test_priorities_survive_a_restart(tmp_path: Path) -> None:
    sp = Spool(tmp_path, max_bytes=1 << 20, fsync_interval_s=None)
    sp.append(rec("a"))
    sp.append(rec("b"), KERNEL)
    sp.append(rec("c"), MATCHED)
    sp.close()
    assert sorted(p.name[16:] for p in tmp_path.iterdir()) == [".p1.seg", ".p2.seg", ".seg"]
    again = Spool(tmp_path, max_bytes=FRAME * 2, fsync_interval_s=None)
    again.append(rec("d"))  # over the bound: the ordinary ones go, oldest first
    assert [v[:1] for v in drain(again)] == [b"b", b"c"]
    with pytest.raises(ValueError, match="spool priority 7"):
        again.append(rec("e"), 7)


def line(source: str, text: str, seq: int = 0) -> LogLine:
    return LogLine(node=NODE, ts_ms=1_000 + seq, source=source, line=text, seq=seq, job=JOB)


def test_an_xid_line_survives_a_log_flood_during_a_broker_outage(tmp_path: Path) -> None:
    """The exporter's own path: ``publish`` with nothing delivering (the broker away)."""
    spool = Spool(tmp_path, max_bytes=256 * 1024, segment_bytes=16 * 1024, fsync_interval_s=None)
    delivery = Delivery(KafkaConfig(), spool)  # never started: nothing leaves the spool
    delivery.publish(line("stdout", "RuntimeError: CUDA error: an illegal memory access was encountered"))
    delivery.publish(line("kernel", XID))
    delivery.publish(ProcessExit(node=NODE, ts_ms=1, pid=42, exit_code=1, job=JOB))
    for i in range(20_000):
        delivery.publish(line("stdout", f"step {i} loss 2.{i % 10} " + "x" * 80, seq=i))
    events = [decode(v) for v in drain(spool)]
    assert spool.dropped_by_priority[ORDINARY] > 15_000
    assert spool.dropped_by_priority[KERNEL] == spool.dropped_by_priority[MATCHED] == 0
    kept = [e for e in events if isinstance(e, LogLine)]
    assert [e.line for e in kept if e.source == "kernel"] == [XID]
    assert any("illegal memory access" in e.line for e in kept)
    assert any(isinstance(e, ProcessExit) for e in events)
    assert kept[-1].line.startswith("step 19999 ")  # the newest ordinary lines are kept


def test_priorities_of_events() -> None:
    p = SpoolPriority()
    assert p(line("kernel", "usb 1-1: new high-speed USB device")) == KERNEL  # the node's own
    assert p(line("nvml", XID)) == KERNEL
    assert p(line("stdout", XID)) == MATCHED  # a rank printing it: a matched line, no more
    assert p(line("stderr", "NCCL WARN NET/IB : Got completion with error 12")) == MATCHED
    assert p(line("stdout", "epoch 3 done")) == ORDINARY
    assert p(TrainingStep(job=JOB, rank=0, step=1, ts_ms=1)) == ORDINARY


@pytest.mark.parametrize("source", ["kernel", "nvml"])
def test_a_rank_cannot_send_a_line_as_the_kernel(source: str) -> None:
    from trainguard.schemas.codec import encode

    raw = encode(line(source, XID))
    with pytest.raises(Rejected, match=f"claims source {source!r}") as err:
        accept(raw, NODE, JOB)
    assert err.value.reason == "invalid"
    assert isinstance(accept(encode(line("stdout", XID)), NODE, JOB), LogLine)


def test_a_ranks_events_carry_this_exporters_node_whatever_they_claim() -> None:
    """A rank naming another machine (or a pod whose hostname is not the node's name) speaks
    for the node it runs on: the exporter sets its own node name (#38)."""
    from trainguard.schemas.codec import encode

    for claimed in ("other-node", "", NODE):
        event = accept(encode(dataclasses.replace(line("stdout", XID), node=claimed)), NODE, JOB)
        assert event.node == NODE
    unbound = accept(encode(line("stdout", XID)), "", JOB)  # no node configured: the event's stands
    assert unbound.node == line("stdout", XID).node
