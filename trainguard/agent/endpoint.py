"""Where an executor reads a node agent's state and sends it commands.

Two readers of the same JSON document (:meth:`NodeAgent.snapshot`):

* ``<state_dir>/state.json``, rewritten atomically on every change: what a process on the node
  reads (``srun --overlap cat``, ``kubectl exec``, the demo), also after the agent died -- a state
  file whose ``pid`` is gone means ``gone``;
* ``GET /state`` on the agent's TCP port, 200 when the warm path is there (zygote warm) and 503
  when it is not: a Kubernetes readiness probe, or one ``curl -f`` from a Slurm executor's host,
  answers "warm or cold?" without a shell on the node.

``POST /command`` takes a command in the control topic's own form: the body is the encoded
:class:`~trainguard.schemas.control.Command` (the Kafka record's value), the four signature
headers travel as HTTP headers (``tg-sig`` base64).  It is checked by the same verifier as the
Kafka path, so the same signature cannot be used twice, through either door.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import tempfile
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from trainguard.infra.signing import H_EXP, H_IAT, H_KID, H_SIG

#: a command is a few hundred bytes; a node list of 100,000 machines is still under this.
MAX_BODY = 4 << 20


def write_state(path: Path, doc: dict[str, Any]) -> None:
    """``doc`` as JSON at ``path``, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def headers_from_http(get: Callable[[str], str | None]) -> list[tuple[str, bytes]]:
    """The signature headers of an HTTP request as the verifier takes them (``tg-sig`` decoded
    from base64; ValueError if it is not).  Absent ones stay absent: the verifier names them."""
    out: list[tuple[str, bytes]] = []
    for name in (H_KID, H_IAT, H_EXP, H_SIG):
        value = get(name)
        if value is None:
            continue
        if name == H_SIG:
            try:
                out.append((name, base64.b64decode(value, validate=True)))
            except (binascii.Error, ValueError):
                raise ValueError(f"header {name} is not base64") from None
        else:
            out.append((name, value.encode()))
    return out


class Endpoint:
    """The agent's HTTP server (on a thread).  ``state()`` gives the document and whether the warm
    path is there; ``submit(body, headers)`` handles a command and gives (HTTP status, reply)."""

    def __init__(
        self,
        host: str,
        port: int,
        state: Callable[[], tuple[dict[str, Any], bool]],
        submit: Callable[[bytes, list[tuple[str, bytes]]], tuple[int, dict[str, Any]]],
        read_timeout_s: float = 10.0,
    ) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            # A client that opens a connection and sends nothing (or a body slower than this)
            # must not hold one of the agent's threads: the socket reads time out.
            timeout = read_timeout_s

            def log_message(self, format: str, *args: Any) -> None:  # the agent logs outcomes itself
                return

            def _reply(self, status: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc, sort_keys=True).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/state":
                    self._reply(404, {"error": "GET /state"})
                    return
                doc, warm = endpoint.state()
                self._reply(200 if warm else 503, doc)

            def do_POST(self) -> None:
                if self.path != "/command":
                    self._reply(404, {"error": "POST /command"})
                    return
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                except ValueError:
                    length = -1
                if not 0 < length <= MAX_BODY:
                    self._reply(400, {"outcome": "refused", "reason": f"body of {length} bytes"})
                    return
                body = self.rfile.read(length)
                try:
                    headers = headers_from_http(self.headers.get)
                except ValueError as exc:
                    self._reply(400, {"outcome": "refused", "reason": str(exc)})
                    return
                self._reply(*endpoint.submit(body, headers))

        self.state, self.submit = state, submit
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="agent-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5.0)
