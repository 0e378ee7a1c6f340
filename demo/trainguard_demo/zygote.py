"""A machine's zygote: imports torch and the trainer once, then forks warm pool processes on request.

``python -m trainguard_demo.zygote --cluster-dir D --machine M`` pays the expensive part of a
rank's start (``import torch``, the trainer, :func:`~trainguard_demo.trainer.prewarm`) once per
machine and then waits.  A request file ``machines/M/zygote/requests/<pool>.json``
(``{"pool", "slots"}``, written by :func:`request_pool`) makes it ``fork()`` one process per slot;
each child starts its own session (so killing it kills exactly it and its DataLoader worker),
takes the command line of a warm process (``python -m trainguard_demo.standby --cluster-dir D
--machine M --pool P --slot I``) and behaves exactly like one (:func:`~trainguard_demo.standby.
serve_slot`).  A new pool is ready in milliseconds instead of the tens of seconds a fresh
interpreter needs on a busy 2-core host -- which is what decides whether the *next* restart is warm.

Forking after torch is imported is what every DataLoader worker does: the zygote runs no torch
threads (one intra-op thread, no process group, no CUDA) and no Python threads, so the child
starts from a consistent copy.  The zygote reaps its children; ``machines/M/zygote/pid.json``
says whether it is ``starting`` or ``ready``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from trainguard.infra.proctable import LIVE
from trainguard_demo.config import ClusterPaths, write_atomic


def _dir(cluster_dir: str | os.PathLike[str], machine: str) -> Path:
    return ClusterPaths(Path(cluster_dir)).machine(machine) / "zygote"


def zygote_pid(cluster_dir: str | os.PathLike[str], machine: str) -> int | None:
    """The pid of ``machine``'s zygote if one is running (starting or ready)."""
    try:
        pid = int(json.loads((_dir(cluster_dir, machine) / "pid.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None
    return pid if "trainguard_demo.zygote" in LIVE.argv(pid) else None


def request_pool(cluster_dir: str | os.PathLike[str], machine: str, slots: int) -> str | None:
    """Ask ``machine``'s zygote for a pool of ``slots`` warm processes; the pool id, or None
    when the machine has no zygote (start processes the slow way then)."""
    if zygote_pid(cluster_dir, machine) is None:
        return None
    pool = f"{time.time_ns():x}"  # same ids as launch_standby: ordered by creation
    write_atomic(
        _dir(cluster_dir, machine) / "requests" / f"{pool}.json", json.dumps({"pool": pool, "slots": slots})
    )
    return pool


def pending_requests(cluster_dir: str | os.PathLike[str], machine: str) -> int:
    """Requests the zygote has not served yet (it is still starting, or busy)."""
    try:
        return sum(1 for _ in (_dir(cluster_dir, machine) / "requests").glob("*.json"))
    except OSError:
        return 0


def _fork_slot(cluster_dir: str, machine: str, pool: str, slot: int) -> int:
    logs = ClusterPaths(Path(cluster_dir)).machine(machine) / "logs" / "standby"
    logs.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: never return into the zygote's loop
        os.setsid()
        for fd, name in ((1, f"{pool}-slot-{slot}.out"), (2, f"{pool}-slot-{slot}.err")):
            out = os.open(logs / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
        import setproctitle

        from trainguard_demo.standby import StandbyConfig, serve_slot

        setproctitle.setproctitle(
            f"{sys.executable} -m trainguard_demo.standby --cluster-dir {cluster_dir} "
            f"--machine {machine} --pool {pool} --slot {slot}"
        )
        code = serve_slot(StandbyConfig(cluster_dir, machine, slot, pool))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        # The reporter's excepthook reports the exit (with its traceback) like a normal crash.
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(cluster_dir: str, machine: str, poll_s: float = 0.05) -> None:
    """Import, announce, then fork pools for requests until killed."""
    d = _dir(cluster_dir, machine)
    (d / "requests").mkdir(parents=True, exist_ok=True)
    write_atomic(d / "pid.json", json.dumps({"pid": os.getpid(), "status": "starting"}))
    from trainguard_demo.trainer import prewarm

    prewarm()
    write_atomic(d / "pid.json", json.dumps({"pid": os.getpid(), "status": "ready", "ts": time.time()}))
    print(f"zygote {machine}: ready", flush=True)
    while True:
        for req in sorted((d / "requests").glob("*.json")):
            try:
                spec = json.loads(req.read_text())
                pool, slots = str(spec["pool"]), int(spec["slots"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                print(f"zygote {machine}: bad request {req.name}: {exc}", file=sys.stderr, flush=True)
                req.unlink(missing_ok=True)
                continue
            pids = [_fork_slot(cluster_dir, machine, pool, s) for s in range(slots)]
            req.unlink(missing_ok=True)
            print(f"zygote {machine}: pool {pool} -> pids {pids}", flush=True)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:  # reap finished children
                pass
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard_demo.zygote", description="a machine's zygote")
    p.add_argument("--cluster-dir", required=True)
    p.add_argument("--machine", required=True)
    a = p.parse_args(argv)
    try:
        serve(a.cluster_dir, a.machine)
    except KeyboardInterrupt:
        return 0
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
