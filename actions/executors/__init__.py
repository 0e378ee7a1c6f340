"""Executor plugins: the interface, the registry and the built-in dry-run executor."""

from actions.executors import dry_run as _dry_run  # noqa: F401  (registers "dry_run")
from actions.executors.base import (
    DiagnosticResult,
    Executor,
    ExecutorEnv,
    StepContext,
    available_executors,
    create_executor,
    register_executor,
)

__all__ = [
    "DiagnosticResult",
    "Executor",
    "ExecutorEnv",
    "StepContext",
    "available_executors",
    "create_executor",
    "register_executor",
]
