"""What an executor (or an operator) calls to use node agents (:mod:`trainguard.agent`): build a
signed command, send it to an agent's ``POST /command``, read its ``GET /state``.  Standard library
plus the signer; in ``infra`` so that the action service's executors (a layer below the agent) use it.

>>> cmd = restart_command("llm", "n2", 3, ["n1", "n2"], "n1", 29512)
>>> cmd.kind.value, cmd.node, cmd.args["generation"], cmd.args["nodes"]
('agent_restart', 'n2', 3, ['n1', 'n2'])
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any

from trainguard.infra.signing import H_SIG, Signer
from trainguard.schemas.base import now_ms
from trainguard.schemas.codec import encode
from trainguard.schemas.control import Command, CommandKind, stable_id
from trainguard.schemas.topics import COMMANDS


def restart_command(
    job: str,
    node: str,
    generation: int,
    nodes: list[str],
    master_addr: str,
    master_port: int,
    code_version: str = "",
) -> Command:
    """The ``agent_restart`` of ``node`` (its id derived from job, node and generation, so a
    retried send is the same command).  ``code_version``: an urgent hot update."""
    args: dict[str, Any] = {
        "generation": generation,
        "nodes": list(nodes),
        "master_addr": master_addr,
        "master_port": master_port,
    }
    if code_version:
        args["code_version"] = code_version
    return Command(
        command_id=stable_id(job, node, "agent_restart", generation),
        ts_ms=now_ms(),
        kind=CommandKind.AGENT_RESTART,
        node=node,
        job=job,
        args=args,
    )


def code_command(job: str, node: str, code_version: str) -> Command:
    """The ``agent_code`` of ``node``: a lazy hot update, taken at its next restart."""
    return Command(
        command_id=stable_id(job, node, "agent_code", code_version),
        ts_ms=now_ms(),
        kind=CommandKind.AGENT_CODE,
        node=node,
        job=job,
        args={"code_version": code_version},
    )


def signed_request(cmd: Command, signer: Signer) -> tuple[bytes, dict[str, str]]:
    """The body and HTTP headers of ``cmd``: signed exactly as its Kafka record would be (topic,
    key = its node), so the agent checks both the same way."""
    body = encode(cmd)
    headers = {}
    for name, value in signer.headers(COMMANDS.name, COMMANDS.key_of(cmd), body):
        headers[name] = base64.b64encode(value).decode() if name == H_SIG else value.decode()
    return body, headers


def post(
    url: str, body: bytes, headers: dict[str, str], timeout_s: float = 30.0
) -> tuple[int, dict[str, Any]]:
    """POST a signed command to ``url`` (``http://node:port``): (HTTP status, the agent's reply)."""
    req = urllib.request.Request(
        url.rstrip("/") + "/command",
        data=body,
        headers={**headers, "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 403 refused, 400 malformed: the reply says why
        return exc.code, json.loads(exc.read() or b"{}")


def send(url: str, cmd: Command, signer: Signer, timeout_s: float = 30.0) -> tuple[int, dict[str, Any]]:
    """Sign and POST ``cmd``."""
    return post(url, *signed_request(cmd, signer), timeout_s=timeout_s)


def state(url: str, timeout_s: float = 5.0) -> tuple[bool, dict[str, Any]]:
    """(warm, the state document) of the agent at ``url``; (False, {}) when it does not answer --
    an agent that is not there is a cold path too."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/state", timeout=timeout_s) as resp:
            return resp.status == 200, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return False, json.loads(exc.read() or b"{}")
    except (OSError, ValueError):
        return False, {}
