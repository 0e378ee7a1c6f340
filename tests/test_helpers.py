"""The suite's own helpers: waiting on a condition and free ports."""

from __future__ import annotations

import socket

import pytest

from tests.net import free_port, free_port_range, free_ports
from tests.waiting import wait_until


def test_wait_until_returns_the_first_truthy_value() -> None:
    calls = iter([None, 0, [], [7]])
    assert wait_until(lambda: next(calls), 5, "a list", interval_s=0.001) == [7]


def test_wait_until_names_what_it_awaited_and_describes_it_only_on_timeout() -> None:
    described: list[int] = []

    def what() -> str:
        described.append(1)
        return "the answer; last seen: nothing"

    assert wait_until(lambda: 42, 1, what) == 42 and described == []
    with pytest.raises(AssertionError, match=r"timed out after 0.05 s waiting for the answer; last seen"):
        wait_until(lambda: False, 0.05, what, interval_s=0.01)
    assert described == [1]


def test_free_ports_can_be_bound() -> None:
    ports = [free_port(), *free_ports(3)]
    assert len(set(ports[1:])) == 3
    base = free_port_range(4)
    for port in (*ports, *range(base, base + 4)):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
