"""Shared CLI state: the loaded settings, progress on stderr unless ``--quiet``, and turning known
errors into clean exits."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from trainguard.infra.config import Settings, load_settings, with_home_note
from trainguard.infra.progress import Progress

F = TypeVar("F", bound=Callable[..., Any])

#: errors whose message is the whole story: printed without a traceback, exit code 2.  Named, not
#: imported: a command imports only its own role's modules (the exporter has no ClickHouse store),
#: and an error class whose module was never imported cannot have been raised.
USER_ERRORS = (
    ("trainguard.infra.stack.procs", "StackError"),
    ("trainguard.infra.clickhouse.store", "StoreError"),
    ("trainguard.infra.bus", "BusError"),
    ("trainguard.schemas.config", "ConfigError"),
)


def user_errors() -> tuple[type[BaseException], ...]:
    """The classes of :data:`USER_ERRORS` that are loaded."""
    return tuple(getattr(sys.modules[mod], name) for mod, name in USER_ERRORS if mod in sys.modules)


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


def home_hint(message: str) -> str:
    """``message``, and the stack home that was looked in with what chose it when the message
    names a path there (a key or state not found in a home the user did not expect)."""
    ctx = click.get_current_context(silent=True)
    obj = ctx.obj if ctx is not None else None
    loaded = obj.get("settings") if isinstance(obj, dict) else None
    return with_home_note(loaded, message) if isinstance(loaded, Settings) else message


def friendly_errors(fn: F) -> F:
    """Decorator: report USER_ERRORS as ``Error: ...`` and exit 2 instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, user_errors()):
                raise click.ClickException(home_hint(str(exc))) from exc
            raise

    return wrapper  # type: ignore[return-value]
