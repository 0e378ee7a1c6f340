"""Loading one component's config dataclass from defaults, a YAML file and environment variables.

Every component (stack, store, exporter, detectors, workers, action service) declares one
frozen dataclass of settings.  This module fills it, in increasing priority, from:

1. the dataclass defaults;
2. a mapping (usually a section of a YAML file);
3. environment variables ``<PREFIX>__<FIELD>[__<SUBFIELD>...]`` (case-insensitive), whose
   values are parsed as YAML scalars so ``"5"`` becomes ``5`` and ``"true"`` becomes ``True``.

Unknown keys -- in the file or in the environment under the prefix -- are errors, so a typo in
``TRAINGUARD_KAFKA__BOOTSTRAP_SERVER`` fails loudly instead of silently using the default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from trainguard.schemas.typecheck import SchemaError, from_mapping

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, mistyped or unknown."""


def _parse_scalar(text: str) -> Any:
    import yaml  # local: keeps `schemas` importable where PyYAML is absent (node side)

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _field_names(cls: Any) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _env_overrides(cls: type, prefix: str, environ: Mapping[str, str]) -> dict[str, Any]:
    """Nested dict of overrides from ``PREFIX__A__B=value`` variables."""
    out: dict[str, Any] = {}
    marker = prefix.upper() + "__"
    for key, raw in environ.items():
        if not key.upper().startswith(marker):
            continue
        parts = [p.lower() for p in key[len(marker) :].split("__")]
        target_cls: Any = cls
        node = out
        for i, part in enumerate(parts):
            fields = _field_names(target_cls) if dataclasses.is_dataclass(target_cls) else {}
            if part not in fields:
                raise ConfigError(f"environment variable {key}: unknown setting {'.'.join(parts[: i + 1])!r}")
            sub_cls = _resolve(target_cls, part)
            if i == len(parts) - 1:
                # Strings stay verbatim: a password "0123" or "yes" must not turn into a number/bool.
                node[part] = raw if sub_cls in (str, str | None) else _parse_scalar(raw)
            else:
                node = node.setdefault(part, {})
                target_cls = sub_cls
    return out


def _resolve(cls: type, name: str) -> Any:
    import typing

    return typing.get_type_hints(cls)[name]


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated with ``extra``, nested mappings merged key by key (``extra`` wins).

    >>> deep_merge({"a": {"x": 1, "y": 2}, "b": 1}, {"a": {"y": 3}})
    {'a': {'x': 1, 'y': 3}, 'b': 1}
    """
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(
    cls: type[T],
    data: Mapping[str, Any] | None = None,
    *,
    env_prefix: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Build ``cls`` from ``data`` plus ``env_prefix`` overrides; raise :class:`ConfigError`.

    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Demo:
    ...     port: int = 1
    ...     host: str = "127.0.0.1"
    >>> load_config(Demo, {"port": 9}, env_prefix="X", environ={"X__HOST": "db"})
    Demo(port=9, host='db')
    >>> load_config(Demo, {"prot": 9})
    Traceback (most recent call last):
    ...
    trainguard.schemas.config.ConfigError: Demo: unknown field(s) 'prot'
    """
    merged = dict(data or {})
    if env_prefix:
        merged = deep_merge(
            merged, _env_overrides(cls, env_prefix, os.environ if environ is None else environ)
        )
    try:
        return from_mapping(cls, merged)
    except SchemaError as exc:
        where = f"{cls.__name__}.{exc.path}" if exc.path else cls.__name__
        raise ConfigError(f"{where}: {exc.reason}") from None


def load_yaml_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML config file; the top level must be a mapping."""
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping, got {type(data).__name__}")
    return data
