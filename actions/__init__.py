"""The action service: decisions in, recoveries out (ByteRobust §4.2-§4.3, §6).

Decisions from the stream workers are accepted into a durable progress store, mapped to plans
(:mod:`actions.plans`), and executed step by step through an executor plugin
(:mod:`actions.executors`) under an explicit state machine (:mod:`actions.state`), with a
blast-radius guard and a restart budget (:mod:`actions.guard`).
"""

from actions.config import ActionsConfig, StepPolicy
from actions.errors import PermanentError, TemporaryError
from actions.plans import Plan, PlanContext, Step, StepKind, build_plan
from actions.state import InvalidStateTransition, RecoveryState

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
