"""The action service: decisions in, recoveries out (ByteRobust §4.2-§4.3, §6).

Decisions from the stream workers are accepted into a durable progress store, mapped to plans
(:mod:`trainguard.actions.plans`), and executed step by step through an executor plugin
(:mod:`trainguard.actions.executors`) under an explicit state machine
(:mod:`trainguard.actions.state`), with a blast-radius guard and a restart budget
(:mod:`trainguard.actions.guard`).
"""

from trainguard.actions.config import ActionsConfig, StepPolicy
from trainguard.actions.errors import PermanentError, TemporaryError
from trainguard.actions.plans import Plan, PlanContext, Step, StepKind, build_plan
from trainguard.actions.state import InvalidStateTransition, RecoveryState

__all__ = [
    "ActionsConfig",
    "InvalidStateTransition",
    "PermanentError",
    "Plan",
    "PlanContext",
    "RecoveryState",
    "Step",
    "StepKind",
    "StepPolicy",
    "TemporaryError",
    "build_plan",
]
