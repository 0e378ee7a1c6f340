"""What a node agent's ranks look like in one generation of the job (pure: no I/O, no clock).

A :class:`World` is what a restart command carries: the generation, the job's machines in rank
order, the rendezvous address and port, and the code version.  :func:`world_of` reads one from a
command's arguments (ValueError when malformed: the command is dead-lettered), :func:`judge` says
whether an agent acts on it, and :func:`rank_env` is the environment of one forked rank.

>>> w = world_of({"generation": 2, "nodes": ["n1", "n3"], "master_addr": "n1", "master_port": 29511})
>>> judge(w, current=1, node="n3"), judge(w, current=2, node="n3"), judge(w, current=1, node="n2")
('restart', 'stale', 'standby')
>>> env = rank_env(w, "n3", local_rank=1, ranks_per_node=2, job="llm")
>>> env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"], env["TRAINGUARD_GENERATION"]
('3', '4', '29511', '2')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainguard.schemas import names

#: a code version names a directory: no separators, no "..".
_MAX_VERSION = 128


@dataclass(frozen=True)
class World:
    generation: int
    nodes: tuple[str, ...]
    master_addr: str
    master_port: int
    #: "" = keep the agent's current code version.
    code_version: str = ""


def check_version(version: Any) -> str:
    """``version`` if it is a usable code version name, else ValueError.

    >>> check_version("v2")
    'v2'
    >>> check_version("../etc")
    Traceback (most recent call last):
    ...
    ValueError: code_version '../etc' must be a plain directory name
    """
    if not isinstance(version, str) or len(version) > _MAX_VERSION:
        raise ValueError(f"code_version must be a string of at most {_MAX_VERSION} characters")
    if version and ("/" in version or "\\" in version or version in (".", "..") or "\x00" in version):
        raise ValueError(f"code_version {version!r} must be a plain directory name")
    return version


def world_of(args: dict[str, Any]) -> World:
    """The world of an ``agent_restart`` command's arguments; ValueError names the bad one."""
    gen = args.get("generation")
    if isinstance(gen, bool) or not isinstance(gen, int) or not 0 <= gen < 2**62:
        raise ValueError(f"generation must be a non-negative integer, got {gen!r}")
    nodes = args.get("nodes")
    # An empty list is a world without machines: every agent stops its ranks and stays warm (the
    # slurm executor's warm ``stop``, so the restart that follows is still warm).
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise ValueError(f"nodes must be a list of node names, got {nodes!r}")
    for n in nodes:
        why = names.NODE.problem(n)
        if why is not None:
            raise ValueError(f"nodes: {n!r}: {why}")
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"nodes lists a machine twice: {nodes}")
    addr = args.get("master_addr")
    if not isinstance(addr, str) or not addr or len(addr) > 255:
        raise ValueError(f"master_addr must be a host name or address, got {addr!r}")
    port = args.get("master_port")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"master_port must be a port number, got {port!r}")
    return World(gen, tuple(nodes), addr, port, check_version(args.get("code_version", "")))


def judge(world: World, current: int, node: str) -> str:
    """What an agent at generation ``current`` on ``node`` does with ``world``: ``stale`` (not
    newer: ignored, so a redelivered or reordered command is harmless), ``restart`` (its node is
    in the world: fork its ranks there) or ``standby`` (not in it: stop its ranks, stay warm)."""
    if world.generation <= current:
        return "stale"
    return "restart" if node in world.nodes else "standby"


def rank_env(world: World, node: str, local_rank: int, ranks_per_node: int, job: str) -> dict[str, str]:
    """torch's and TrainGuard's variables for ``local_rank`` on ``node`` (which must be in the world):
    a replacement takes the position, hence the ranks, of the machine it replaced."""
    rank = world.nodes.index(node) * ranks_per_node + local_rank
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(len(world.nodes) * ranks_per_node),
        "LOCAL_WORLD_SIZE": str(ranks_per_node),
        "GROUP_RANK": str(world.nodes.index(node)),
        "MASTER_ADDR": world.master_addr,
        "MASTER_PORT": str(world.master_port),
        "TRAINGUARD_JOB": job,
        "TRAINGUARD_RANK": str(rank),
        "TRAINGUARD_NODE": node,
        # every rank's machine in rank order, as `trainguard launch` names it
        "TRAINGUARD_MACHINES": ",".join(world.nodes),
        "TRAINGUARD_GENERATION": str(world.generation),
    }


def entry_of(command: list[str]) -> tuple[str, str, list[str]]:
    """How a forked child runs ``command``: (``"path"`` or ``"module"``, the script or module,
    its ``sys.argv``); ValueError for a command that is not a Python script or module.

    >>> entry_of(["python3", "train.py", "--lr", "1e-3"])
    ('path', 'train.py', ['train.py', '--lr', '1e-3'])
    >>> entry_of(["/usr/bin/python", "-u", "-m", "pkg.train", "-x"])
    ('module', 'pkg.train', ['pkg.train', '-x'])
    """
    if not command or "python" not in command[0].rsplit("/", 1)[-1]:
        raise ValueError(f"the agent forks Python only: {command[:1]} is not a Python interpreter")
    rest = list(command[1:])
    while rest and rest[0] in ("-u", "-B", "-O", "-s"):  # options that change nothing in a fork
        rest.pop(0)
    if len(rest) >= 2 and rest[0] == "-m":
        return "module", rest[1], [rest[1], *rest[2:]]
    if rest and not rest[0].startswith("-"):
        return "path", rest[0], rest
    raise ValueError(f"cannot fork {' '.join(command)!r}: give `python SCRIPT ...` or `python -m MODULE ...`")
