"""Executor plugins: the interface and the registry (executors are found by entry point)."""

from trainguard.actions.executors.base import (
    DiagnosticResult,
    Executor,
    ExecutorEnv,
    ExecutorPlugin,
    StepContext,
    available_executors,
    create_executor,
    register_executor,
)

__all__ = [
    "DiagnosticResult",
    "Executor",
    "ExecutorEnv",
    "ExecutorPlugin",
    "StepContext",
    "available_executors",
    "create_executor",
    "register_executor",
]
