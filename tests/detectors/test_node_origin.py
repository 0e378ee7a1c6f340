"""A rank cannot evict a machine by printing a kernel line (#38 item 1): the node inspector lets the
rule table's kernel/driver rows fire only on lines the node exporter read from the node itself."""

from __future__ import annotations

import pytest

from trainguard.detectors.node_inspector import NodeInspector
from trainguard.schemas.enums import Action
from trainguard.schemas.workload import NODE_LOG_SOURCES, LogLine

# The demo's injected line (demo/trainguard_demo/inject.py), in the format of a real kernel log.
XID = "Nov 27 21:54:01 m0 kernel: [  101.000000] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
PANIC = "[ 9021.554210] Kernel panic - not syncing: Fatal exception in interrupt"  # host.yaml's cited line


def _actions(source: str, line: str, node: str = "m0") -> list[Action]:
    insp = NodeInspector()
    event = LogLine(node=node, ts_ms=1_000, source=source, line=line, seq=1, job="j", rank=0)
    return [d.action for d in insp.inspect(event, 1_000)]


@pytest.mark.parametrize("source", sorted(NODE_LOG_SOURCES))
def test_the_nodes_own_lines_evict(source: str) -> None:
    assert Action.EVICT in _actions(source, XID)
    assert Action.EVICT in _actions(source, PANIC)


@pytest.mark.parametrize("source", ["stdout", "stderr", "trainguard", "/var/log/train.log"])
def test_the_same_line_printed_by_a_rank_does_nothing(source: str) -> None:
    assert _actions(source, XID) == []
    assert _actions(source, PANIC) == []


def test_a_ranks_own_faults_still_count_from_its_output() -> None:
    line = "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert _actions("stderr", line) == [Action.DIAGNOSE]
