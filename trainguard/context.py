"""Shared CLI state: the loaded settings, progress on stderr unless ``--quiet``, and turning known
errors into clean exits."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import click

from infra.bus import BusError
from infra.clickhouse.store import StoreError
from infra.config import Settings, load_settings
from infra.progress import Progress
from infra.stack.procs import StackError
from schemas.config import ConfigError

F = TypeVar("F", bound=Callable[..., Any])

#: errors whose message is the whole story: printed without a traceback, exit code 2.
USER_ERRORS = (StackError, StoreError, BusError, ConfigError)


def settings(ctx: click.Context) -> Settings:
    obj = ctx.ensure_object(dict)
    if "settings" not in obj:
        obj["settings"] = load_settings(obj.get("config_path"))
    loaded: Settings = obj["settings"]
    return loaded


def progress(
    ctx: click.Context, label: str, total: float | None = None, unit: str = "", summary: bool = True
) -> Progress:
    """A progress line on stderr for a long command (none with ``trainguard --quiet``)."""
    quiet = bool(ctx.ensure_object(dict).get("quiet"))
    return Progress(label, total, unit, enabled=not quiet, summary=summary)


def friendly_errors(fn: F) -> F:
    """Decorator: report USER_ERRORS as ``Error: ...`` and exit 2 instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper  # type: ignore[return-value]
