"""The reporter socket's access control: mode 0660, and each event's job bound to its sender's
kernel-verified credentials (``SCM_CREDENTIALS``), over a real socket and real sender processes."""

from __future__ import annotations

import grp
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.exporter.conftest import make_cfg
from tests.waiting import wait_until
from trainguard.schemas.base import Event
from trainguard.schemas.codec import encode
from trainguard.schemas.config import ConfigError
from trainguard.schemas.workload import ProcessExit, TrainingStep
from trainguard.streams.exporter.sources.base import SourceContext
from trainguard.streams.exporter.sources.reporter import (
    MAX_DATAGRAM,
    Peer,
    ReporterSource,
    bind_socket,
    peer_of,
)

REPO = Path(__file__).resolve().parents[2]
UID = os.getuid()


def _source(root: Path, tmp_path: Path, job: str = "job-t", **reporter: Any) -> ReporterSource:
    src = ReporterSource(SourceContext(make_cfg(root, tmp_path, job=job, reporter=reporter)))
    src.collect()  # binds the socket
    return src


@pytest.fixture
def sources() -> Iterator[list[ReporterSource]]:
    """Sources to close after the test, whatever its outcome."""
    made: list[ReporterSource] = []
    yield made
    for src in made:
        src.close()


def _step(job: str, step: int = 0) -> bytes:
    return encode(TrainingStep(job=job, rank=0, step=step, ts_ms=1_700_000_000_000))


def _send(path: Path, *datagrams: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        for d in datagrams:
            s.sendto(d, str(path))


def _settle(src: ReporterSource, events: int, rejected: int, timeout: float = 10.0) -> list[Event]:
    """What the source published once it has ``events`` published and ``rejected`` refused."""
    got: list[Event] = []

    def done() -> bool:
        got.extend(src.collect())
        return len(got) >= events and src.rejected >= rejected

    wait_until(
        done,
        timeout,
        lambda: f"{events} events and {rejected} refusals; got {got}, refused {src.rejected_by}",
        interval_s=0.01,
    )
    return got


def test_socket_is_0660_and_group_configurable(root: Path, tmp_path: Path, sources: list) -> None:
    src = _source(root, tmp_path)
    sources.append(src)
    st = src.path.stat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == os.getegid()
    # By name where it has one: a group this process is in (any gid when root).
    gid = 1 if os.geteuid() == 0 else os.getegid()
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    sock = bind_socket(tmp_path / "g.sock", 0o620, group)
    sock.close()
    st = (tmp_path / "g.sock").stat()
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o620, gid)
    with pytest.raises(ValueError, match="no such group"):
        bind_socket(tmp_path / "x.sock", group="no-such-group-trainguard")


def test_each_datagram_carries_its_senders_credentials(tmp_path: Path) -> None:
    sock = bind_socket(tmp_path / "c.sock")
    sock.setblocking(True)
    try:
        _send(tmp_path / "c.sock", b"hello")
        raw, ancdata, _flags, _addr = sock.recvmsg(MAX_DATAGRAM, socket.CMSG_SPACE(12))  # struct ucred
    finally:
        sock.close()
    assert raw == b"hello"
    assert peer_of(ancdata) == Peer(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
    assert peer_of([]) is None


def test_claim_of_another_job_is_refused(root: Path, tmp_path: Path, sources: list) -> None:
    src = _source(root, tmp_path)
    sources.append(src)
    _send(src.path, _step("job-t", 0), _step("", 1), _step("other", 2))
    got = _settle(src, 2, 1)
    assert [(e.step, e.job) for e in got if isinstance(e, TrainingStep)] == [(0, "job-t"), (1, "job-t")]
    assert src.rejected == 1 and src.rejected_by["job"] == 1
    assert src.collect() == []  # the refused claim is never published


def test_uid_binding_wins_over_the_exporters_job(
    root: Path, tmp_path: Path, sources: list, caplog: pytest.LogCaptureFixture
) -> None:
    src = _source(root, tmp_path, job_by_uid={str(UID): "bound"})
    sources.append(src)
    caplog.set_level(logging.WARNING, "trainguard.streams.exporter.sources.reporter")
    _send(src.path, _step("", 0) + b"\n" + _step("bound", 1), _step("job-t", 2), _step("other", 3))
    got = _settle(src, 2, 2)
    assert [(e.step, e.job) for e in got if isinstance(e, TrainingStep)] == [(0, "bound"), (1, "bound")]
    assert src.rejected_by["job"] == 2
    assert f"pid {os.getpid()} uid {UID}" in caplog.text and "claims job 'other'" in caplog.text


def test_without_binding_the_senders_job_stands(root: Path, tmp_path: Path, sources: list) -> None:
    src = _source(root, tmp_path, job="")
    sources.append(src)
    _send(src.path, _step("mine"), _step("yours"))
    got = _settle(src, 2, 0)
    assert sorted(e.job for e in got if isinstance(e, TrainingStep)) == ["mine", "yours"]
    assert src.rejected == 0


def test_uid_not_allowed_is_refused(root: Path, tmp_path: Path, sources: list) -> None:
    other = UID + 1 if UID < 2**32 - 2 else 1
    src = _source(root, tmp_path, allowed_uids=[other])
    sources.append(src)
    assert UID not in src.allowed_uids
    _send(src.path, _step("job-t", 0), _step("job-t", 1))

    def refused() -> bool:
        return src.rejected_by["uid"] == 2

    wait_until(refused, 10, lambda: f"2 datagrams refused by uid; {src.rejected_by}", interval_s=0.01)
    assert src.collect() == [] and src.rejected == 2


def test_default_allows_own_uid_and_root_and_bound_uids(root: Path, tmp_path: Path) -> None:
    src = ReporterSource(SourceContext(make_cfg(root, tmp_path, reporter={"job_by_uid": {"4242": "j"}})))
    assert src.allowed_uids == {0, os.getuid(), os.geteuid(), 4242}


def test_garbage_is_still_refused(root: Path, tmp_path: Path, sources: list) -> None:
    src = _source(root, tmp_path)
    sources.append(src)
    heartbeat = b'{"schema": "heartbeat", "version": 1, "node": "x", "component": "c", "ts_ms": 1}'
    _send(src.path, b"\xff\x00 not json", heartbeat)
    assert _settle(src, 0, 2) == []
    assert src.rejected_by["invalid"] == 2 and src.rejected == 2


SENDER = """
from trainguard.streams.reporter import Reporter
rep = Reporter(job={job!r}, rank=5, socket_path={sock!r}, capture_exceptions=False, capture_sigterm=False)
rep.step(0, loss=1.0)
rep.close(exit_code=0)
"""


def _reporter_process(sock: Path, job: str) -> int:
    """Run a Reporter in its own process to its end; its pid."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER.format(job=job, sock=str(sock))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    return proc.pid


def test_reporter_in_another_process(
    root: Path, tmp_path: Path, sources: list, caplog: pytest.LogCaptureFixture
) -> None:
    src = _source(root, tmp_path)
    sources.append(src)
    caplog.set_level(logging.WARNING, "trainguard.streams.exporter.sources.reporter")
    pid = _reporter_process(src.path, "job-t")
    got = _settle(src, 2, 0)
    (step,) = [e for e in got if isinstance(e, TrainingStep)]
    (exit_ev,) = [e for e in got if isinstance(e, ProcessExit)]
    assert (step.job, step.rank, step.node) == ("job-t", 5, "node-t")
    assert (exit_ev.job, exit_ev.pid) == ("job-t", pid)
    # Another process claiming another job: refused, and the log names its pid and uid.
    pid = _reporter_process(src.path, "other")
    assert _settle(src, 0, 2) == []
    assert src.rejected_by["job"] == 2 and f"pid {pid} uid {UID}" in caplog.text


def _send_as(path: Path, datagram: bytes, uid: int, gid: int, groups: list[int]) -> int:
    """Send ``datagram`` from a forked child running as ``uid``/``gid``; its exit status:
    0 sent, 13 permission denied (EACCES), other values a failure."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(datagram, str(path))
            code = 0
        except PermissionError:
            code = 13
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_user_in_the_socket_group_is_bound_by_uid(root: Path, tmp_path: Path, sources: list) -> None:
    nobody, group = 65534, 54321
    shared = Path(tempfile.mkdtemp(prefix="tg-reporter-"))  # pytest's tmp dirs are 0700
    try:
        shared.chmod(0o711)
        sock = shared / "r.sock"
        src = _source(
            root, tmp_path, socket=str(sock), socket_group=str(group), job_by_uid={str(nobody): "tenant"}
        )
        sources.append(src)
        assert _send_as(sock, _step(""), nobody, group, [group]) == 0  # in the group: may send
        assert _send_as(sock, _step("job-t"), nobody, group, [group]) == 0  # claims the exporter's job
        assert _send_as(sock, _step(""), nobody, nobody, []) == 13  # not in the group: 0660 says no
        got = _settle(src, 1, 1)
        assert [e.job for e in got if isinstance(e, TrainingStep)] == ["tenant"] and src.rejected_by[
            "job"
        ] == 1
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_job_by_uid_keys_must_be_uids(root: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a uid"):
        make_cfg(root, tmp_path, reporter={"job_by_uid": {"alice": "j"}})
    with pytest.raises(ConfigError, match="empty job"):
        make_cfg(root, tmp_path, reporter={"job_by_uid": {"1000": ""}})
