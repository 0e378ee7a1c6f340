"""The config model: defaults <- YAML <- env, unknown keys rejected everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from trainguard.infra.config import Settings, component_config, load_settings
from trainguard.schemas.config import ConfigError


def test_defaults_point_at_the_embedded_stack() -> None:
    s = load_settings(environ={})
    assert s.kafka.bootstrap_servers == "127.0.0.1:19092"
    assert s.clickhouse.url == "http://127.0.0.1:18123"
    assert s.stack.embedded


def test_yaml_then_env_override(tmp_path: Path) -> None:
    f = tmp_path / "tg.yaml"
    f.write_text(
        "kafka:\n  bootstrap_servers: k1:9092,k2:9092\n  security_protocol: SASL_SSL\n"
        "  sasl_mechanism: SCRAM-SHA-512\n  sasl_username: tg\nclickhouse:\n  host: ch.prod\n  port: 8443\n"
        "  secure: true\nstack:\n  embedded: false\n"
    )
    s = load_settings(
        f, environ={"TRAINGUARD__KAFKA__SASL_PASSWORD": "0123", "TRAINGUARD__CLICKHOUSE__PORT": "9443"}
    )
    assert s.kafka.servers == ["k1:9092", "k2:9092"]
    assert s.kafka.sasl_password == "0123"  # strings stay strings, not the number 123
    kw = s.kafka.client_kwargs()
    assert kw["sasl_plain_username"] == "tg" and kw["security_protocol"] == "SASL_SSL"
    assert s.clickhouse.url == "https://ch.prod:9443"


def test_custom_embedded_ports_follow_through_to_clients(tmp_path: Path) -> None:
    s = load_settings(environ={"TRAINGUARD__STACK__KAFKA_PORT": "29092", "TRAINGUARD_HOME": str(tmp_path)})
    assert s.kafka.bootstrap_servers == "127.0.0.1:29092"
    assert s.stack.home_path == tmp_path.resolve()


@pytest.mark.parametrize(
    ("yaml_text", "env", "message"),
    [
        ("kafka:\n  bootstrap_server: x:1\n", {}, "Settings.kafka: unknown field(s) 'bootstrap_server'"),
        ("klickhouse: {}\n", {}, "Settings: unknown field(s) 'klickhouse'"),
        ("", {"TRAINGUARD__KAFKA__BOOTSTRAP_SERVER": "x"}, "unknown setting 'kafka.bootstrap_server'"),
        ("stack:\n  kafka_port: 70000\n", {}, "Settings.stack.kafka_port: 70000 is above the maximum 65535"),
        ("kafka:\n  security_protocol: TLS\n", {}, "security_protocol must be one of"),
        ("- just\n- a list\n", {}, "top level must be a mapping"),
        ("stack: [1\n", {}, "not valid YAML"),
    ],
)
def test_config_errors_are_precise(tmp_path: Path, yaml_text: str, env: dict[str, str], message: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_settings(f, environ=env)
    assert message in str(err.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "nope.yaml", environ={})


def test_settings_is_one_model() -> None:
    assert set(Settings.__dataclass_fields__) == {
        "kafka",
        "clickhouse",
        "stack",
        "signing",
        "components",
        "environ",
    }


@dataclass(frozen=True)
class _Worker:
    batch_size: int = 10
    app_id: str = "tg"


def test_component_sections_are_validated_by_their_component(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("kafka:\n  client_id: x\nworker:\n  batch_size: 5\n")
    s = load_settings(f, environ={"TRAINGUARD__WORKER__APP_ID": "other"})
    assert component_config(s, "worker", _Worker) == _Worker(batch_size=5, app_id="other")
    f.write_text("worker:\n  batch_sise: 5\n")
    with pytest.raises(ConfigError, match="unknown field"):
        component_config(load_settings(f, environ={}), "worker", _Worker)
    with pytest.raises(ConfigError, match="unknown setting 'nope'"):
        component_config(load_settings(environ={"TRAINGUARD__WORKER__NOPE": "1"}), "worker", _Worker)


def test_secrets_never_appear_in_a_repr(tmp_path: Path) -> None:
    """Configs are logged and shown in tracebacks: passwords stay out of their reprs."""
    cfg = tmp_path / "tg.yaml"
    cfg.write_text(
        "kafka: {sasl_mechanism: PLAIN, sasl_username: u, sasl_password: kafka-s3cret}\n"
        "clickhouse: {password: ch-s3cret}\n"
    )
    settings = load_settings(cfg, environ={})
    assert settings.kafka.sasl_password == "kafka-s3cret" and settings.clickhouse.password == "ch-s3cret"
    shown = repr(settings) + str(settings) + repr(settings.kafka) + repr(settings.clickhouse)
    assert "s3cret" not in shown and "sasl_username='u'" in shown
