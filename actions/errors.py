"""What an executor call can raise, and so whether the step runner retries it (kopf-style).

* :class:`TemporaryError` -- worth retrying (a node not ready yet, an API throttled); ``delay``
  overrides the backoff before the next attempt.
* :class:`PermanentError` -- retrying cannot help (a machine does not exist, bad input); the step
  and so the recovery fail at once.

Any other exception is treated as temporary (bounded by the step's ``retries``): an executor bug
must not escape the consumer loop, but it must not loop forever either.
"""

from __future__ import annotations


class ActionError(Exception):
    """Base of the action service's own errors."""


class TemporaryError(ActionError):
    def __init__(self, message: str, delay: float | None = None) -> None:
        super().__init__(message)
        self.delay = delay


class PermanentError(ActionError):
    pass


class SchedulerError(ActionError):
    """A node operation of ``trainguard nodes`` that the scheduler refused or did not answer (the
    message quotes it); the node's state stays as recorded, and the command may be run again."""


class UnknownNode(SchedulerError):
    """The scheduler has no node of that name."""
