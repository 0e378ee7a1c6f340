"""What an executor (or an operator) calls to use node agents.  The code lives in
:mod:`trainguard.infra.agent_client`, a layer the action service's executors may import (they sit
below the agent in the layers contract); this name stays for the agent's own callers."""

from trainguard.infra.agent_client import code_command, post, restart_command, send, signed_request, state

__all__ = ["code_command", "post", "restart_command", "send", "signed_request", "state"]
