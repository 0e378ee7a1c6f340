"""What the Kubernetes executor names after a job: never one object for two jobs (fast: no API).

The label of a job's pods is a hash (a label value holds 63 characters, so the name itself cut to
63 merged jobs), ConfigMap and state file names are the name when it is one already and a hashed
form otherwise.  The pods themselves are tested against a real API server in
``test_k8s_executor.py::test_jobs_whose_names_share_63_characters_never_touch_each_other``.
"""

from __future__ import annotations

import re

import pytest

from trainguard.actions.executors.kubernetes import _label_value, _object_name, job_label
from trainguard.schemas.names import JOB_NAME_MAX

#: Kubernetes' own rules (apimachinery validation): a label value, a DNS-1123 subdomain.
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

#: pairs the old label (the name made a label value, cut to 63) merged.
MERGED = [
    ("x" * 63 + "-a", "x" * 63 + "-b"),
    ("_llm", "llm"),
    ("llm_", "llm"),
    ("a_b", "a.b"),
    ("Job_A", "job-a"),
]
NAMES = ["llm", "a_b", "A.b", "_x", "x" * JOB_NAME_MAX, *[n for pair in MERGED for n in pair]]


@pytest.mark.parametrize("job", NAMES)
def test_a_job_label_is_a_valid_label_value(job: str) -> None:
    value = job_label(job)
    assert len(value) <= 63 and LABEL_VALUE.fullmatch(value), value
    assert value == job_label(job)  # stable: the next service finds the pods by it


def test_no_two_names_share_a_label() -> None:
    labels = {job_label(n) for n in NAMES}
    assert len(labels) == len(set(NAMES))
    # the collisions the old label had (kept for pods made before: see KubernetesExecutor.pods)
    assert all(_label_value(a) == _label_value(b) for a, b in MERGED if a.startswith("x"))


@pytest.mark.parametrize("job", NAMES)
def test_object_names_are_valid_and_distinct(job: str) -> None:
    name = _object_name(f"{job}-code")
    assert len(name) <= 253 and SUBDOMAIN.fullmatch(name), name
    names = {_object_name(f"{n}-code") for n in NAMES}
    assert len(names) == len(set(NAMES))


def test_a_name_that_is_an_object_name_already_keeps_it() -> None:
    """ConfigMaps and restart counts of jobs made before the change stay where they were."""
    assert _object_name("llm-7b-code") == "llm-7b-code"
    assert _object_name("Job_A-code") != "job-a-code" and _object_name("Job_A-code").startswith("job-a-code-")


def test_no_name_can_be_chosen_to_equal_another_ones_hashed_form() -> None:
    victim = _object_name("Job_A")
    assert victim != "job-a"
    assert _object_name(victim) != victim  # looks hashed: hashed again, so it stays apart
