"""A directory the training processes write too, used without ever following a link out of it.

The Flight Recorder directory (:mod:`trainguard.streams.exporter.flight_recorder`) is shared with
the ranks, which run as the users; the exporter runs as root or its own user.  Anything a path
names in it can be swapped for a symbolic link between two calls -- ``fr/dumps`` made a link to the
exporter's spool once made the stale sweep delete the spool (issue #38).  So the exporter touches
it only through file descriptors:

* every directory is opened component by component, each with ``O_NOFOLLOW | O_DIRECTORY``
  relative to its parent's descriptor, so a link is refused (:class:`UnsafeEntry`) wherever it
  sits, and every later call is relative to the descriptor (``dir_fd``): swapping a name after the
  check changes nothing;
* files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and read only if they are regular files with
  one link (a hard link to a file elsewhere is not read: its content is not the rank's);
* removal unlinks a link itself, never its target, and removes a directory with the
  descriptor-based ``shutil.rmtree(name, dir_fd=...)`` (it refuses links at every level);
* a directory the exporter creates for itself (the quarantine) must be owned by the exporter's
  user, or it is not used (:meth:`SharedDir.own_dir`).

The directory itself (the configured ``flight_recorder.dir``) and its parents are the operator's;
only what is inside is distrusted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeEntry(OSError):
    """An entry of the shared directory that is not what it must be (a link, a file where a
    directory belongs, a directory owned by another user): not used."""


class SharedDir:
    """``path``, a directory shared with less trusted users; see the module docstring."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @contextlib.contextmanager
    def dir(self, *parts: str, create: bool = False, mode: int = 0o755) -> Iterator[int]:
        """A descriptor of ``<path>/<parts...>``, each part one name (no ``/``), opened without
        following a link; missing ones are made when ``create`` (with ``mode``).  Raises
        FileNotFoundError when missing, :class:`UnsafeEntry` for a link or a non-directory."""
        fd = _open_dir(str(self.path), None, str(self.path))
        try:
            where = str(self.path)
            for part in parts:
                if not part or "/" in part or part in (".", ".."):
                    raise UnsafeEntry(errno.EINVAL, f"{part!r} is not one name")
                where = f"{where}/{part}"
                try:
                    child = _open_dir(part, fd, where)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):  # made meanwhile: open it below
                        os.mkdir(part, mode, dir_fd=fd)
                    child = _open_dir(part, fd, where)
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def own_dir(self, *parts: str) -> Iterator[int]:
        """Like :meth:`dir` with ``create``, for a directory the exporter keeps to itself (mode
        0700): one another user made or took is removed (it is inside the shared directory) and
        made again; still not the exporter's -> :class:`UnsafeEntry`."""
        *parent, name = parts
        with self.dir(*parent) as pfd:
            try:
                fd = _open_dir(name, pfd, name)
            except FileNotFoundError:
                fd = -1
            except UnsafeEntry:
                remove(pfd, name)
                fd = -1
            if fd >= 0 and os.fstat(fd).st_uid != os.geteuid():
                os.close(fd)
                remove(pfd, name)
                fd = -1
            if fd < 0:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=pfd)
                fd = _open_dir(name, pfd, name)
                if os.fstat(fd).st_uid != os.geteuid():
                    os.close(fd)
                    raise UnsafeEntry(errno.EPERM, f"{name} is not owned by uid {os.geteuid()}")
        try:
            yield fd
        finally:
            os.close(fd)


def _open_dir(name: str, dir_fd: int | None, where: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        # O_NOFOLLOW on a link: ELOOP; O_DIRECTORY on anything else: ENOTDIR.
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeEntry(exc.errno, f"{where} is a link or not a directory: not followed") from None
        raise


def entries(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """``(name, lstat)`` of every entry of the directory, sorted by name (links not followed)."""
    out = []
    with os.scandir(dir_fd) as it:
        for e in it:
            with contextlib.suppress(FileNotFoundError):  # gone meanwhile
                out.append((e.name, e.stat(follow_symlinks=False)))
    return sorted(out)


def lstat(dir_fd: int, name: str) -> os.stat_result:
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def exists(dir_fd: int, name: str) -> bool:
    try:
        lstat(dir_fd, name)
    except FileNotFoundError:
        return False
    return True


def read_file(dir_fd: int, name: str, max_bytes: int) -> tuple[bytes, int]:
    """(content, mtime in ms) of the regular file ``name``, of one link and at most
    ``max_bytes``.  ValueError names what is wrong; OSError when it cannot be opened (ELOOP:
    a link)."""
    fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{name} is not a regular file")
        if st.st_nlink != 1:
            raise ValueError(f"{name} has {st.st_nlink} links: a file from elsewhere, not read")
        if st.st_size > max_bytes:
            raise ValueError(f"dump is {st.st_size} bytes, over the {max_bytes}-byte limit")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew after the fstat
        raise ValueError(f"dump is over the {max_bytes}-byte limit")
    return data, st.st_mtime_ns // 1_000_000


def write_file(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``name`` atomically (a hidden temporary file made here, renamed over it)."""
    tmp = f".{name}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)  # a crashed run's, or a link put there: only the name goes
    fd = os.open(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd
    )
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def remove(dir_fd: int, name: str) -> None:
    """Remove the entry ``name``: a directory with everything in it, anything else (a link
    included) by its name only.  Never anything outside the directory; gone already is fine."""
    try:
        st = lstat(dir_fd, name)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        # Descriptor-based: it opens every level with O_NOFOLLOW and checks it is what it
        # stat-ed, so a link put in anywhere meanwhile is removed as a link, never followed.
        assert shutil.rmtree.avoids_symlink_attacks
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)


def move(src_fd: int, name: str, dst_fd: int, new_name: str) -> None:
    """Rename ``name`` (the entry itself, whatever it is) into another directory descriptor."""
    os.replace(name, new_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
