"""The agent's HTTP endpoint on its own: a silent or slow client is cut off instead of holding a
thread, and a state request still answers meanwhile."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

from trainguard.agent.endpoint import Endpoint


def test_a_silent_client_is_cut_off_and_others_are_served() -> None:
    ep = Endpoint(
        "127.0.0.1", 0, lambda: ({"state": "warm"}, True), lambda b, h: (200, {}), read_timeout_s=0.5
    )
    ep.start()
    try:
        silent = socket.create_connection(("127.0.0.1", ep.port))
        silent.sendall(b"POST /command HTTP/1.1\r\nContent-Length: 100\r\n")  # and then nothing
        with urllib.request.urlopen(f"http://127.0.0.1:{ep.port}/state", timeout=5) as resp:
            assert resp.status == 200 and json.loads(resp.read()) == {"state": "warm"}
        silent.settimeout(5)
        t0 = time.monotonic()
        assert silent.recv(1024) == b""  # the server closed it after its read timeout
        assert time.monotonic() - t0 < 4
        silent.close()
    finally:
        ep.stop()
