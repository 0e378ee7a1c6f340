"""The zygote: a process that imports torch and the job's modules once, then forks training ranks.

``python -m trainguard.agent.zygote --preload torch,model [--code-dir D]`` is started by the node
agent (:mod:`trainguard.agent.zygote_client`) and speaks JSON lines: requests on stdin, replies on
the stdout it had at start (its own ``print`` goes to stderr, so a chatty import cannot corrupt
the protocol)::

    -> {"op": "fork", "tag": T, "env": {...}, "entry": [kind, target, argv], "log": PATH}
    <- {"op": "ready", "pid": P, "import_s": S}      once, after the preload list imported
    <- {"op": "failed", "error": E}                  instead, and the zygote exits
    <- {"op": "forked", "tag": T, "pid": P}          per fork request
    <- {"op": "exit", "pid": P, "code": C}           per child that ended (C < 0: killed by -C)

Why forking is safe here: the zygote never initialises CUDA, NCCL or a process group (checked
after the imports: it refuses to serve if a preloaded module did), runs no Python threads and
waits in ``select``, so a child starts from a consistent copy -- what every DataLoader worker
relies on too.  Each child starts its own session (the agent kills a rank with its process group)
and runs the job's script or module with ``runpy``, as ``python`` would.  When stdin closes (the
agent is gone) the zygote stops its children and exits: a job never outlives its agent.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import sys
import time
from typing import Any, TextIO


def _say(proto: TextIO, **msg: Any) -> None:
    proto.write(json.dumps(msg) + "\n")
    proto.flush()


def clean_for_fork() -> str:
    """ "" when nothing imported so far holds a GPU context or a process group, else what does.

    >>> clean_for_fork()
    ''
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return ""
    if torch.cuda.is_initialized():
        return "a preloaded module initialised CUDA (fork would copy a broken GPU context)"
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return "a preloaded module created a torch.distributed process group"
    return ""


def _run_child(req: dict[str, Any], proto_fd: int) -> None:
    """In the forked child: become the rank and never return into the zygote's loop."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        os.close(proto_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.environ.clear()
        os.environ.update(req["env"])
        kind, target, argv = req["entry"]
        sys.argv = list(argv)
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _fork(req: dict[str, Any], proto: TextIO, children: set[int]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _run_child(req, proto.fileno())
    children.add(pid)
    _say(proto, op="forked", tag=req.get("tag", ""), pid=pid)


def _reap(proto: TextIO, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _say(proto, op="exit", pid=pid, code=os.waitstatus_to_exitcode(status))


def serve(preload: list[str], code_dir: str, poll_s: float = 0.05) -> int:
    """Import, announce, then fork on request until stdin closes."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # from here on print() goes to the zygote's log, never into the protocol
    if code_dir:
        os.chdir(code_dir)
        sys.path.insert(0, code_dir)
    started = time.monotonic()
    try:
        for name in preload:
            importlib.import_module(name)
    except BaseException as exc:
        _say(proto, op="failed", error=f"import failed: {type(exc).__name__}: {exc}")
        return 1
    why = clean_for_fork()
    if why:
        _say(proto, op="failed", error=why)
        return 1
    # Native threads a library started (they are not copied into a child; harmless unless they
    # hold a lock at the fork): said, so a slow or hung child can be traced back to one.
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    _say(proto, op="ready", pid=os.getpid(), import_s=round(time.monotonic() - started, 3), threads=threads)
    children: set[int] = set()
    buf = b""
    while True:
        readable, _, _ = select.select([0], [], [], poll_s)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:
                break  # the agent is gone
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    req = json.loads(line)
                except ValueError as exc:
                    print(f"zygote: bad request: {exc}", file=sys.stderr, flush=True)
                    continue
                if req.get("op") == "fork":
                    _fork(req, proto, children)
        _reap(proto, children)
    for pid in children:  # their agent is gone: so is the job on this machine
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard.agent.zygote", description=__doc__)
    p.add_argument("--preload", default="", help="comma-separated modules to import before forking")
    p.add_argument("--code-dir", default="", help="the code version's directory (cwd and sys.path[0])")
    a = p.parse_args(argv)
    return serve([m for m in a.preload.split(",") if m], a.code_dir)


if __name__ == "__main__":
    sys.exit(main())
