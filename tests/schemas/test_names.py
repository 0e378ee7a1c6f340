"""Job and node names are checked where they are decoded (``trainguard.schemas.names``).

A name that is a path (``..``, ``a/b``), an option (``-rf``), holds a blank or is 300 characters
long is a :class:`DecodeError` naming the field -- so a consumer dead-letters the record instead of
writing a file, a label or a command line from it -- while every name a cluster really uses (host
names, ``llm-7b.v2``, ``run_3``) still decodes, through the compiled fast path and the general one.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

import pytest

from trainguard.schemas import names
from trainguard.schemas.base import EVENT_TYPES, LOCAL_TYPES, Event
from trainguard.schemas.codec import DecodeError, decode, encode, to_dict
from trainguard.schemas.control import Decision, JobSpec, Targets
from trainguard.schemas.enums import Action
from trainguard.schemas.network import MachinePosition
from trainguard.schemas.topology import JobTopology
from trainguard.schemas.typecheck import from_mapping
from trainguard.schemas.workload import LogLine, TrainingStep

BAD = [
    pytest.param("a/b", "holds '/' at character 1", id="slash"),
    pytest.param("..", "starts with '.'", id="dotdot"),
    pytest.param(".", "starts with '.'", id="dot"),
    pytest.param("../../etc/cron.d/x", "holds '/' at character 2", id="traversal"),
    pytest.param("-rf", "starts with '-'", id="option"),
    pytest.param(".hidden", "starts with '.'", id="hidden"),
    pytest.param("my job", "holds ' ' at character 2", id="blank"),
    pytest.param("job\n2", "holds '\\\\n' at character 3", id="newline"),
    pytest.param("jöb", "holds '\\\\xf6' at character 1", id="non-ascii"),
    pytest.param("j" * 300, "exceeds", id="300-characters"),
]
GOOD_JOBS = ["llm", "llm-7b.v2", "run_3", "_x", "A.b-C_9", "j" * names.JOB_NAME_MAX]
GOOD_NODES = ["n1", "gpu-node01.cluster.local", "ip-10-0-0-1.ec2.internal", "x" * names.NODE_NAME_MAX]


def spec_doc(job: str = "llm", machines: tuple[str, ...] = ("n1", "n2"), **more: Any) -> dict[str, Any]:
    topo = JobTopology(job="llm", tp=1, pp=1, dp=len(machines), ranks_per_machine=1, machines=list(machines))
    doc = to_dict(JobSpec(job="llm", ts_ms=1, topology=topo))
    doc["job"] = job
    doc.update(more)
    return doc


def wire(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


@pytest.mark.parametrize(("name", "why"), BAD)
def test_a_bad_job_name_in_a_spec_is_a_decode_error(name: str, why: str) -> None:
    with pytest.raises(DecodeError, match=why) as err:
        decode(wire(spec_doc(job=name)), expect=JobSpec)
    assert err.value.path == "job_spec.job"


@pytest.mark.parametrize(("name", "why"), BAD)
def test_a_bad_node_name_anywhere_is_a_decode_error(name: str, why: str) -> None:
    doc = spec_doc(machines=("n1", "n2"))
    doc["topology"]["machines"][1] = name
    with pytest.raises(DecodeError, match=why) as err:
        decode(wire(doc))
    assert err.value.path == "job_spec.topology.machines[1]"

    with pytest.raises(DecodeError, match=why) as err:
        decode(wire(spec_doc(standbys=["s1", name])))
    assert err.value.path == "job_spec.standbys[1]"

    with pytest.raises(DecodeError, match=why) as err:
        decode(wire(spec_doc(positions={name: {"pod": "p", "rack": "r"}})))
    assert err.value.path == "job_spec.positions" and "object key" in err.value.reason

    line = to_dict(LogLine(node="n1", ts_ms=1, source="kernel", line="x"))
    with pytest.raises(DecodeError, match=why) as err:
        decode(wire({**line, "node": name}))
    assert err.value.path == "log_line.node"

    d = to_dict(Decision(decision_id="d", ts_ms=1, job="j", action=Action.EVICT, targets=Targets(["n1"])))
    d["targets"]["machines"] = [name]
    with pytest.raises(DecodeError, match=why) as err:
        decode(wire(d))
    assert err.value.path == "decision.targets.machines[0]"


def test_a_spec_must_name_its_job_other_events_may_name_none() -> None:
    with pytest.raises(DecodeError, match="name is empty"):
        decode(wire(spec_doc(job="")))
    step = decode(encode(TrainingStep(job="", rank=0, step=1, ts_ms=1)))  # the exporter binds it
    assert isinstance(step, TrainingStep) and step.job == ""
    line = decode(encode(LogLine(node="", ts_ms=1, source="stdout", line="x")))
    assert isinstance(line, LogLine) and line.node == ""
    doc = spec_doc(machines=("n1", ""))
    with pytest.raises(DecodeError, match="name is empty"):  # a machine of a job is always named
        decode(wire(doc))


@pytest.mark.parametrize("job", GOOD_JOBS)
def test_real_job_names_still_decode(job: str) -> None:
    spec = decode(wire(spec_doc(job=job)))
    assert isinstance(spec, JobSpec) and spec.job == job


@pytest.mark.parametrize("node", GOOD_NODES)
def test_real_node_names_still_decode(node: str) -> None:
    doc = spec_doc(machines=("n1", node), standbys=[node], positions={node: {"pod": "p", "rack": "r"}})
    spec = decode(wire(doc))
    assert isinstance(spec, JobSpec)
    assert spec.topology.machines == ["n1", node] and spec.standbys == [node]
    assert spec.positions == {node: MachinePosition("p", "r")}


@pytest.mark.parametrize(("name", "why"), BAD)
def test_the_fast_and_the_general_path_refuse_the_same_names(name: str, why: str) -> None:
    """``from_mapping`` tries the compiled checker first; a bad name must fall through it to the
    general path, which names the error, whether it sits in a field, a list or a dict key."""
    line = {"node": name, "ts_ms": 1, "source": "kernel", "line": "x"}
    with pytest.raises(ValueError, match=why):
        from_mapping(LogLine, line)
    topo = {"job": "j", "tp": 1, "pp": 1, "dp": 1, "ranks_per_machine": 1, "machines": [name]}
    with pytest.raises(ValueError, match=why):
        from_mapping(JobTopology, topo)


#: field names that hold a job or node name, in any event (checked by the contract test below).
_JOB_FIELDS = {"job"}
_NODE_FIELDS = {"node", "machines", "standbys", "positions"}


def _named_fields(cls: type, prefix: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in _JOB_FIELDS | _NODE_FIELDS:
            out.append((f"{prefix}{f.name}", dict(f.metadata)))
        for inner in (hints[f.name], *typing.get_args(hints[f.name])):
            if dataclasses.is_dataclass(inner) and isinstance(inner, type):
                out += _named_fields(inner, f"{prefix}{f.name}.")
    return out


@pytest.mark.parametrize("cls", [*EVENT_TYPES.values(), *LOCAL_TYPES.values()], ids=lambda c: c.TYPE)
def test_every_job_and_node_field_declares_its_name_rule(cls: type[Event]) -> None:
    missing = []
    for path, meta in _named_fields(cls):
        rule = meta.get("name")
        leaf = path.rsplit(".", 1)[-1]
        want = (names.JOB, names.JOB_OR_NONE) if leaf in _JOB_FIELDS else (names.NODE, names.NODE_OR_NONE)
        if rule not in want:
            missing.append(f"{cls.TYPE}.{path}: {rule}")
    assert not missing, "\n".join(missing)
