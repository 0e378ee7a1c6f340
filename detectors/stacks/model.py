"""Plain records for parsed py-spy dumps: frames, thread stacks and one process's dump.

Frames are kept innermost first, as py-spy prints them.  Filenames are normalised to the
package-relative form py-spy's ``short_filename`` uses (``torch/distributed/distributed_c10d.py``,
``threading.py``), so dumps taken with and without ``--full-filenames``, or on machines with
different install prefixes, compare equal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Install prefixes that differ between machines but not between stacks: everything up to and
# including them is dropped (site-packages, dist-packages, the stdlib's lib/pythonX.Y).
_PREFIX = re.compile(r"^.*/(?:site-packages|dist-packages|lib/python\d+(?:\.\d+)?)/")


def normalize_filename(path: str) -> str:
    """Package-relative filename.

    >>> normalize_filename("/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py")
    'torch/distributed/distributed_c10d.py'
    >>> normalize_filename("/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py")
    'threading.py'
    >>> normalize_filename("fixture_job.py")
    'fixture_job.py'
    """
    if "/" not in path:
        return path
    return _PREFIX.sub("", path, count=1)


@dataclass(frozen=True, slots=True)
class Frame:
    """One Python (or, with ``--native``, native) frame; ``line`` is 0 when unknown."""

    name: str
    filename: str
    line: int = 0

    def label(self) -> str:
        return f"{self.name} ({self.filename})"


@dataclass(frozen=True, slots=True)
class ThreadStack:
    """One thread of a process: its name (``MainThread``...), py-spy activity and frames."""

    thread_id: int | None
    name: str
    active: bool | None
    frames: tuple[Frame, ...]


@dataclass(frozen=True, slots=True)
class ProcessDump:
    """Every thread of one process at one instant, as dumped by py-spy."""

    pid: int
    threads: tuple[ThreadStack, ...]
    source: str = ""

    def main_thread(self) -> ThreadStack | None:
        """The interpreter's main thread; training loops run there.

        py-spy's JSON lists threads in no fixed order, so pick by name, then by the thread whose
        OS id is the pid (the initial thread on Linux), then the first listed.
        """
        for t in self.threads:
            if t.name == "MainThread":
                return t
        for t in self.threads:
            if t.thread_id == self.pid:
                return t
        return self.threads[0] if self.threads else None


# rank<R>_pid<P>.txt|json and rank<R>_worker<K>_pid<P>.txt|json
_DUMP_NAME = re.compile(r"^rank(?P<rank>\d+)(?:_worker(?P<worker>\d+))?_pid(?P<pid>\d+)\.(?P<fmt>txt|json)$")


@dataclass(frozen=True, slots=True)
class DumpName:
    """What a dump file's name says: whose process it is and in which format."""

    rank: int
    worker: int | None
    pid: int
    fmt: str

    @classmethod
    def parse(cls, name: str) -> DumpName | None:
        """``None`` when the name does not follow the dump naming scheme.

        >>> DumpName.parse("rank3_worker0_pid812.json")
        DumpName(rank=3, worker=0, pid=812, fmt='json')
        >>> DumpName.parse("notes.txt") is None
        True
        """
        m = _DUMP_NAME.match(name)
        if m is None:
            return None
        worker = m.group("worker")
        return cls(
            int(m.group("rank")), None if worker is None else int(worker), int(m.group("pid")), m["fmt"]
        )
