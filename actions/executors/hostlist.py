"""Slurm's compressed host lists (``n[1-3,7],gpu[08-09]``): the executor's, the launcher's and
topology.conf's node lists all use them."""

from __future__ import annotations

import re


def expand_hostlist(expr: str) -> list[str]:
    """Slurm's compressed host list (``n[1-3,7],gpu[08-09]``) as names, in order.

    >>> expand_hostlist("n[1-3,7],gpu[08-09],login")
    ['n1', 'n2', 'n3', 'n7', 'gpu08', 'gpu09', 'login']
    >>> expand_hostlist("r[1-2]-n[1-2]"), expand_hostlist("(null)"), expand_hostlist("")
    (['r1-n1', 'r1-n2', 'r2-n1', 'r2-n2'], [], [])
    """
    expr = expr.strip()
    if expr in ("", "(null)", "None"):
        return []
    items, depth, cur = [], 0, ""
    for ch in expr:  # split on commas outside brackets
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += (ch == "[") - (ch == "]")
        cur += ch
    items.append(cur)
    out: list[str] = []
    for item in filter(None, items):
        m = re.search(r"\[([^\]]*)\]", item)
        if m is None:
            out.append(item)
            continue
        head, tail = item[: m.start()], item[m.end() :]
        for rng in m.group(1).split(","):
            lo, _, hi = rng.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                out.extend(expand_hostlist(f"{head}{i:0{width}d}{tail}"))
    return out
