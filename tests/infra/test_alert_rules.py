"""The Prometheus alert rules (infra/deploy/prometheus): valid for Prometheus, each alert seen
firing and not firing by its unit tests (``promtool test rules``), and naming only metrics the
components expose."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.infra.metric_names import DEPLOY, component_names, used

RULES = DEPLOY / "prometheus" / "trainguard-alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "trainguard-alerts.test.yml"
SEVERITIES = {"critical", "warning"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool is needed: run scripts/setup.sh (the Debian package prometheus)"
    return subprocess.run(
        [exe, *args], cwd=RULES.parent, capture_output=True, text=True, timeout=120, check=False
    )


def alerts() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_promtool_accepts_the_rule_file() -> None:
    done = promtool("check", "rules", RULES.name)
    assert done.returncode == 0, f"promtool check rules:\n{done.stdout}\n{done.stderr}"
    assert f"SUCCESS: {len(alerts())} rules found" in done.stdout


def test_every_alert_fires_and_stays_quiet_in_its_unit_tests() -> None:
    done = promtool("test", "rules", RULE_TESTS.name)
    assert done.returncode == 0, f"promtool test rules:\n{done.stdout}\n{done.stderr}"
    # Each alert is tested both ways: with an expected alert at some time, and with none.
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [case for group in tests for case in group["alert_rule_test"]]
    for rule in alerts():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']} is never expected to fire"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']} is never expected to stay quiet"


def test_every_alert_waits_has_a_severity_and_says_what_to_do() -> None:
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names))
    required = {
        "TrainGuardRecoveryStuck",
        "TrainGuardJobNotTraining",
        "TrainGuardExporterDown",
        "TrainGuardExporterSourceSilent",
        "TrainGuardConsumerLagHigh",
        "TrainGuardDeadLettersRising",
        "TrainGuardSinkBehind",
    }
    assert required <= set(names)
    for rule in alerts():
        assert rule.get("for"), f"{rule['alert']} has no for:"
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 80, rule["alert"]


def test_the_rules_name_only_metrics_the_components_expose(tmp_path: Path) -> None:
    exposed = set().union(*component_names(tmp_path).values())
    # Prose may name a histogram by its family name (the expressions use its series).
    families = exposed | {n.removesuffix("_bucket") for n in exposed}
    named: set[str] = set()
    for rule in alerts():
        missing = used(rule["expr"]) - exposed
        missing |= used(" ".join(rule["annotations"].values())) - families
        assert not missing, f"{rule['alert']} names metrics no component exposes: {sorted(missing)}"
        named |= used(rule["expr"])
    # Each component's metrics feed some alert.
    names = component_names(tmp_path)
    for component in ("worker", "exporter", "actions"):
        assert named & names[component], f"no alert reads a metric of the {component}"


@pytest.mark.parametrize("job", ["trainguard-worker", "trainguard-exporter", "trainguard-actions"])
def test_the_scrape_jobs_the_rules_name_are_the_services_of_the_manifests(job: str) -> None:
    services = yaml.safe_load_all((DEPLOY / "k8s" / "base" / "services.yaml").read_text())
    assert job in {s["metadata"]["name"] for s in services if s}
    assert f'job="{job}"' in RULES.read_text()
