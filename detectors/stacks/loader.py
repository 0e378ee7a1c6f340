"""Reading a directory of per-rank py-spy dumps into rounds of :class:`RankDumps`.

Layout: ``DIR/rank<R>_pid<P>.txt|.json`` (a rank's main process) and
``DIR/rank<R>_worker<K>_pid<P>.txt|.json`` (its child processes), or ``DIR/round<N>/`` folders
of such files for several rounds.  Other files (manifests, notes) are ignored; a file whose
name starts like a dump but does not follow the scheme, or whose content is not a py-spy dump,
raises :class:`StackParseError` naming it.  File reading only: no network, no subprocesses.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from trainguard.detectors.stacks.model import DumpName, ProcessDump
from trainguard.detectors.stacks.parse import DumpParser, StackParseError

_ROUND = re.compile(r"^round(\d+)$")


@dataclass(frozen=True, slots=True)
class RankDumps:
    """One rank's dumps in one round: the main process (``None`` if absent) and its children."""

    rank: int
    main: ProcessDump | None
    children: tuple[ProcessDump, ...] = ()


#: One round: rank -> its dumps.  Ranks absent from the mapping had no dump at all.
Round = dict[int, RankDumps]


def collect_round(
    entries: Iterable[tuple[str, str]], parser: DumpParser | None = None, prefer: str = "json"
) -> Round:
    """Build a round from ``(file name, content)`` pairs named by the dump scheme.

    When one process was dumped in both formats, both are parsed (a malformed file is an error
    either way) and the ``prefer`` format is used.
    """
    parser = parser or DumpParser()
    chosen: dict[tuple[int, int | None, int], tuple[str, list[ProcessDump]]] = {}
    for name, text in entries:
        dn = DumpName.parse(name)
        if dn is None:
            raise StackParseError(f"{name}: not a dump file name (expected rank<R>_pid<P>.txt|json)")
        dumps = parser.parse(text, dn.fmt, name, dn.pid)
        key = (dn.rank, dn.worker, dn.pid)
        if key not in chosen or dn.fmt == prefer:
            chosen[key] = (dn.fmt, dumps)
    mains: dict[int, ProcessDump] = {}
    children: dict[int, list[ProcessDump]] = {}
    for (rank, worker, pid), (_fmt, dumps) in sorted(
        chosen.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1)
    ):
        for d in dumps:
            if worker is None and d.pid == pid:
                if rank in mains:
                    raise StackParseError(
                        f"{d.source}: rank {rank} already has a main-process dump (pid {mains[rank].pid})"
                    )
                mains[rank] = d
            else:
                # A worker file, or a --subprocesses dump listing the children after the main.
                children.setdefault(rank, []).append(d)
    ranks = sorted(set(mains) | set(children))
    return {r: RankDumps(r, mains.get(r), tuple(children.get(r, ()))) for r in ranks}


def _read_dir(path: Path, parser: DumpParser, prefer: str) -> Round:
    entries = []
    for f in sorted(path.iterdir()):
        if not f.is_file() or f.suffix not in (".txt", ".json") or not f.name.startswith("rank"):
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise StackParseError(f"{f}: cannot read dump: {exc}") from None
        entries.append((f.name, text))
    try:
        return collect_round(entries, parser, prefer)
    except StackParseError as exc:
        raise StackParseError(f"{path}/{exc}") from None


def load_dump_dir(path: str | Path, parser: DumpParser | None = None, prefer: str = "json") -> list[Round]:
    """Every round under ``path``: ``round<N>/`` folders in N order, or ``path`` itself as one."""
    root = Path(path)
    if not root.is_dir():
        raise StackParseError(f"{root}: not a directory")
    parser = parser or DumpParser()
    round_dirs = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _ROUND.match(p.name))),
    )
    if round_dirs:
        if any(DumpName.parse(p.name) for p in root.iterdir() if p.is_file()):
            raise StackParseError(f"{root}: holds both round<N>/ folders and dump files; use one layout")
        rounds = [_read_dir(p, parser, prefer) for _, p in round_dirs]
    else:
        rounds = [_read_dir(root, parser, prefer)]
    if not any(rounds):
        raise StackParseError(f"{root}: no rank<R>_pid<P>.txt|json dump files found")
    return rounds
