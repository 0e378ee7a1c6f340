"""What a job or node name may be: checked wherever one is decoded, so nothing downstream meets a
name that is a path, a shell word or a label it cannot hold.

A name is ``[A-Za-z0-9._-]``, does not start with ``.`` or ``-`` (so never ``.``, ``..``, a hidden
file or a command-line option), and is at most :data:`JOB_NAME_MAX` (jobs) or
:data:`NODE_NAME_MAX` (nodes) characters.  Why these:

* the Slurm executor builds ``<state dir>/slurm/<job>.json``, ``<job>/step-<n>.log`` and
  ``<job>.standby-<op>`` from a job name: without ``/`` and a leading ``.``, a name is one path
  component inside the directory (``tests/actions/test_slurm_names.py``); 128 characters keep every
  such file name far below ``NAME_MAX`` (255 bytes: the names are ASCII, one byte a character)
  and match the limit of ids (``trainguard.schemas.limits.ID``);
* a node name is a host name: 253 characters is the longest DNS name, and so the longest
  Kubernetes node name (a DNS-1123 subdomain) and any Slurm ``NodeName`` a site uses;
* the characters are those of a Kubernetes label value, a Slurm job name and a file name alike,
  so no mapping between them can merge two names (Kubernetes still hashes the job label: a label
  value holds only 63 characters, ``trainguard.actions.executors.kubernetes``).

``""`` stays valid where a field says "none" (a log line of no job); the fields that must name
something (a job spec's job) refuse it.

>>> NODE.problem("gpu-node01.cluster")
>>> JOB.problem("..")
"name '..' starts with '.' (a name may not start with '.' or '-')"
>>> JOB.problem("a/b")
"name 'a/b' holds '/' at character 1 (allowed: letters, digits, '.', '_', '-')"
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: longest job name (see the module docstring for why).
JOB_NAME_MAX = 128
#: longest node name: the longest DNS name (RFC 1035), so any host or Kubernetes node name.
NODE_NAME_MAX = 253

_ALLOWED = "letters, digits, '.', '_', '-'"
_BAD_CHAR = re.compile(r"[^A-Za-z0-9._-]")


def _show(text: str) -> str:
    # A short, printable repr (the schema module's ``show`` imports this module's users).
    return repr(text if len(text) <= 60 else text[:57] + "...").encode("ascii", "backslashreplace").decode()


@dataclass(frozen=True)
class NameRule:
    """The rule of one kind of name: ``ok`` is the fast check (a compiled regex's ``fullmatch``;
    not None when valid), :meth:`problem` says why a name fails it."""

    what: str
    max_len: int
    empty_ok: bool

    @property
    def pattern(self) -> re.Pattern[str]:
        return _PATTERNS[(self.max_len, self.empty_ok)]

    def problem(self, text: str) -> str | None:
        """Why ``text`` is not a valid name (None when it is)."""
        if self.pattern.fullmatch(text) is not None:
            return None
        if not text:
            return f"{self.what} is empty"
        if len(text) > self.max_len:
            return f"{self.what} of {len(text)} characters exceeds {self.max_len}"
        bad = _BAD_CHAR.search(text)
        if bad is not None:
            return (
                f"{self.what} {_show(text)} holds {_show(bad[0])} at character {bad.start()} "
                f"(allowed: {_ALLOWED})"
            )
        first = _show(text[0])
        return f"{self.what} {_show(text)} starts with {first} (a name may not start with '.' or '-')"

    def check(self, text: str) -> str:
        """``text`` if valid, else ValueError naming the problem."""
        why = self.problem(text)
        if why is not None:
            raise ValueError(why)
        return text


def _pattern(max_len: int, empty_ok: bool) -> re.Pattern[str]:
    body = rf"[A-Za-z0-9_][A-Za-z0-9._-]{{0,{max_len - 1}}}"
    return re.compile(f"(?:{body})?" if empty_ok else body)


_PATTERNS = {(n, e): _pattern(n, e) for n in (JOB_NAME_MAX, NODE_NAME_MAX) for e in (True, False)}

#: a job name that must be there (a job spec's).
JOB = NameRule("name", JOB_NAME_MAX, empty_ok=False)
#: a job name, or "" where a field may name no job.
JOB_OR_NONE = NameRule("name", JOB_NAME_MAX, empty_ok=True)
#: a node name that must be there (a machine of a job).
NODE = NameRule("name", NODE_NAME_MAX, empty_ok=False)
#: a node name, or "" where a field may name no node.
NODE_OR_NONE = NameRule("name", NODE_NAME_MAX, empty_ok=True)
