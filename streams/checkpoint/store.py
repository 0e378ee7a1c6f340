"""A machine's checkpoint files: shards and held backups, each made complete by a manifest.

Layout under the configured directory (the machine's own disk)::

    <job>/holder-<H>/r<RANK>-s<STEP>.shard     the serialized state of rank RANK at step STEP
    <job>/holder-<H>/r<RANK>-s<STEP>.json   its manifest: job, step, rank, world size, size, sha256

``holder-H`` is the folder of the rank-H process on this machine: its own shards (RANK == H)
and the backups it holds for its peers.  The shard is written under a temporary name and
renamed, then the manifest the same way, so a manifest's presence means its shard is whole; the
sha256 in it catches a shard torn or altered later, or a manifest forged for other bytes; its
``mac`` (HMAC-SHA256 under the job's checkpoint key, ``TRAINGUARD_CHECKPOINT_KEY``) catches a
shard and manifest forged together by anyone who can reach a backup port but does not hold the
job's key.  Every path is built from a validated job name and integers, never from a name a peer sent.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeAlias

from trainguard.schemas import names

#: a shard as the writer hands it out: its parts in order (zero-copy views of the snapshot).
Parts: TypeAlias = Sequence[bytes | bytearray | memoryview]

#: manifest format; another version is not trusted.
MANIFEST_VERSION = 2
_SHARD = re.compile(r"^r(\d{5,7})-s(\d{9,12})\.json$")


class ShardError(ValueError):
    """A shard or manifest is malformed, foreign, torn or fails its checksum."""


@dataclass(frozen=True)
class Manifest:
    """What one shard file holds, written after it (its presence makes the shard complete)."""

    job: str
    step: int
    rank: int
    world_size: int
    size: int
    sha256: str
    version: int = MANIFEST_VERSION
    #: HMAC-SHA256 (hex) of the fields above under the job's key; "" when the job runs without one.
    mac: str = ""

    @classmethod
    def from_dict(cls, raw: Any) -> Manifest:
        """Validate a manifest read from disk or received from a peer; :class:`ShardError` if bad."""
        if not isinstance(raw, dict) or set(raw) != {f for f in cls.__dataclass_fields__}:
            raise ShardError(f"malformed manifest: {str(raw)[:200]!r}")
        ints = ("step", "rank", "world_size", "size", "version")
        if not all(type(raw[k]) is int and raw[k] >= 0 for k in ints):
            raise ShardError(f"manifest numbers must be non-negative integers: {str(raw)[:200]!r}")
        m = cls(**raw)
        if m.version != MANIFEST_VERSION:
            raise ShardError(f"manifest version {m.version}, expected {MANIFEST_VERSION}")
        if not isinstance(m.job, str) or names.JOB.problem(m.job) is not None:
            raise ShardError(f"bad job name in manifest: {m.job!r}")
        if not isinstance(m.sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", m.sha256):
            raise ShardError("manifest sha256 is not 64 hex digits")
        if not isinstance(m.mac, str) or not re.fullmatch(r"(?:[0-9a-f]{64})?", m.mac):
            raise ShardError("manifest mac is not 64 hex digits")
        if m.rank >= m.world_size or m.step >= 10**12 or m.rank >= 10**7:
            raise ShardError(f"manifest rank {m.rank} / step {m.step} out of range")
        return m

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _mac_of(self, key: bytes) -> str:
        body = json.dumps({k: v for k, v in asdict(self).items() if k != "mac"}, sort_keys=True)
        return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()

    def signed(self, key: bytes) -> Manifest:
        """This manifest with its ``mac`` under ``key`` (unchanged without a key)."""
        return replace(self, mac=self._mac_of(key)) if key else self

    def authentic(self, key: bytes) -> bool:
        """True when ``key`` is empty (a job without a key) or ``mac`` is this manifest's under it."""
        return not key or hmac.compare_digest(self.mac, self._mac_of(key))


def shard_name(rank: int, step: int) -> str:
    return f"r{rank:05d}-s{step:09d}"


def write_atomic(path: Path, data: bytes | Parts, *, fsync: bool) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for part in [data] if isinstance(data, bytes) else data:
                f.write(part)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class ShardStore:
    """The checkpoint files of one job on this machine; ``holder`` is this process's rank."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        job: str,
        holder: int,
        *,
        fsync: bool = False,
        key: bytes = b"",
    ):
        problem = names.JOB.problem(job)
        if problem is not None:
            raise ShardError(f"bad job name: {problem}")
        self.job, self.holder, self.fsync = job, holder, fsync
        #: the job's checkpoint key: every manifest kept, served or restored carries its mac.
        self.key = key
        self.root = Path(directory) / job
        self.dir = self.root / f"holder-{holder:05d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        #: (path, size, mtime_ns) -> verdict: a listed shard is hashed once, not on every list.
        self._verified: dict[tuple[str, int, int], str | None] = {}
        # The writer thread and the server's request threads share the store.
        self._lock = threading.Lock()

    def put(self, manifest: Manifest, data: bytes | Parts, *, verify: bool = True) -> Path:
        """Store ``data`` as ``manifest`` says (checked against it first, unless the caller has
        just computed the manifest from these very bytes); returns the shard path."""
        if verify:
            check(manifest, data, self.job, self.key)
        base = self.dir / shard_name(manifest.rank, manifest.step)
        # A manifest left by an earlier write of this step must not vouch for the new bytes.
        base.with_suffix(".json").unlink(missing_ok=True)
        write_atomic(base.with_suffix(".shard"), data, fsync=self.fsync)
        write_atomic(base.with_suffix(".json"), json.dumps(manifest.to_dict()).encode(), fsync=self.fsync)
        return base.with_suffix(".shard")

    def commit_file(self, manifest: Manifest, tmp: Path) -> None:
        """Rename an already verified temporary file (received from a peer) into place."""
        base = self.dir / shard_name(manifest.rank, manifest.step)
        base.with_suffix(".json").unlink(missing_ok=True)
        os.replace(tmp, base.with_suffix(".shard"))
        write_atomic(base.with_suffix(".json"), json.dumps(manifest.to_dict()).encode(), fsync=self.fsync)

    def _entries(self) -> list[tuple[Path, int, int]]:
        out = []
        for holder in self.root.glob("holder-*"):
            for mf in holder.iterdir():
                hit = _SHARD.match(mf.name)
                if hit:
                    out.append((mf, int(hit.group(1)), int(hit.group(2))))
        return out

    def inventory(self) -> tuple[list[Manifest], list[str]]:
        """The verified shards on this machine (every holder's), and why the others are not."""
        good: dict[tuple[int, int], Manifest] = {}
        bad: list[str] = []
        for mf, rank, step in self._entries():
            try:
                m = self._verify(mf, rank, step)
            except (OSError, ShardError) as exc:
                bad.append(f"step {step} rank {rank} ({mf.parent.name}): {exc}")
                continue
            good[(m.step, m.rank)] = m
        return sorted(good.values(), key=lambda m: (m.step, m.rank)), bad

    def _verify(self, mf: Path, rank: int, step: int) -> Manifest:
        m = Manifest.from_dict(json.loads(mf.read_bytes()))
        if (m.job, m.rank, m.step) != (self.job, rank, step):
            raise ShardError("manifest names another shard than its file")
        pt = mf.with_suffix(".shard")
        st = pt.stat()
        key = (str(pt), st.st_size, st.st_mtime_ns)
        with self._lock:
            verdict = self._verified.get(key, "")
        if verdict == "":
            try:
                check(m, pt.read_bytes(), self.job, self.key)
                verdict = None
            except ShardError as exc:
                verdict = str(exc)
            with self._lock:
                self._verified[key] = verdict
        if verdict is not None:
            raise ShardError(verdict)
        return m

    def read(self, rank: int, step: int) -> tuple[Manifest, bytes]:
        """A verified shard of (rank, step) from any holder on this machine; :class:`ShardError` if none."""
        errors = []
        for holder in sorted(self.root.glob("holder-*"), key=lambda p: p != self.dir):
            base = holder / shard_name(rank, step)
            try:
                m = Manifest.from_dict(json.loads(base.with_suffix(".json").read_bytes()))
                data = base.with_suffix(".shard").read_bytes()
                check(m, data, self.job, self.key)
                if (m.rank, m.step) != (rank, step):
                    raise ShardError("manifest names another shard than its file")
                return m, data
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                errors.append(f"{holder.name}: {exc}")
        raise ShardError(
            f"no valid local copy of rank {rank} step {step}" + "".join(f"; {e}" for e in errors)
        )

    def prune(self, rank: int, keep: int) -> None:
        """Keep the newest ``keep`` steps of ``rank`` in this holder's folder."""
        steps = sorted(s for mf, r, s in self._entries() if r == rank and mf.parent == self.dir)
        for step in steps[:-keep]:
            base = self.dir / shard_name(rank, step)
            # Manifest first: a shard without one is incomplete, never a shard vouched for by a stale one.
            base.with_suffix(".json").unlink(missing_ok=True)
            base.with_suffix(".shard").unlink(missing_ok=True)
        with self._lock:
            self._verified = {k: v for k, v in self._verified.items() if Path(k[0]).exists()}


def digest(parts: bytes | Parts) -> tuple[int, str]:
    """(size, sha256 hex) of a shard given whole or in parts."""
    h, size = hashlib.sha256(), 0
    for part in [parts] if isinstance(parts, bytes) else parts:
        h.update(part)
        size += len(part) if not isinstance(part, memoryview) else part.nbytes
    return size, h.hexdigest()


def check(manifest: Manifest, data: bytes | Parts, job: str, key: bytes = b"") -> None:
    """Raise :class:`ShardError` unless ``data`` is what ``manifest`` (of ``job``, signed with
    ``key`` when the job has one) describes."""
    if manifest.job != job:
        raise ShardError(f"shard of job {manifest.job!r}, this is job {job!r}")
    if not manifest.authentic(key):
        raise ShardError("manifest mac does not verify: not written by a rank holding the job's key")
    size, sha = digest(data)
    if size != manifest.size:
        raise ShardError(f"size {size} != manifest's {manifest.size} (truncated?)")
    if sha != manifest.sha256:
        raise ShardError("sha256 mismatch: the shard or its manifest is corrupt or forged")
