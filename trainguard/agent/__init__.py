"""The warm node agent (issue #37): a resident process per job and machine that holds a zygote
(torch and the job's modules imported, no CUDA) and restarts the machine's ranks in place -- new
world, new generation, new code version -- on a signed command, in about a second instead of a
cold interpreter and torch start.  :mod:`~trainguard.agent.service` is the agent,
:mod:`~trainguard.agent.client` what an executor calls."""

__all__ = ["AgentConfig"]

from trainguard.agent.config import AgentConfig
