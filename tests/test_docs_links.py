"""The documentation's relative links resolve: every ``[text](target)`` in the README, ``docs/``,
``infra/deploy/``, ``bench/README.md`` and ``CHANGELOG.md`` points at a file or folder that
exists, and a ``#anchor`` on a markdown target names one of its headings (GitHub's slugs).  The
README stays a front page (at most 220 lines).  No network, no servers: it reads files only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 220

#: an inline link or image: [text](target) or [text](target "title"); one level of nested
#: brackets in the text (a code span with brackets, an image inside a link).
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "bench" / "README.md"]
    for folder in (REPO / "docs", REPO / "infra" / "deploy"):
        files += sorted(folder.rglob("*.md"))
    return files


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((no, _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, punctuation dropped (letters,
    digits, ``_`` and ``-`` kept), spaces to ``-``.

    >>> slug("Named queries (`trainguard sql`)")
    'named-queries-trainguard-sql'
    >>> slug("`actions.breaker` (BreakerConfig)")
    'actionsbreaker-breakerconfig'
    >>> slug("[Link](x.md) and *emphasis*")
    'link-and-emphasis'
    >>> slug("`actions.steps.<kind>` (StepPolicy)")
    'actionsstepskind-steppolicy'
    """
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    # Code spans render their text as is; outside them, * is emphasis and <tag> is HTML.
    parts = re.split(r"(`+[^`]*`+)", text)
    text = "".join(
        p.strip("`") if p.startswith("`") else re.sub(r"</?[A-Za-z][^>]*>", "", p).replace("*", "")
        for p in parts
    )
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file, repeats numbered as GitHub does (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative link of a markdown file."""
    out = []
    for no, line in prose_lines(path.read_text(encoding="utf-8")):
        for m in _LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
                continue  # http:, https:, mailto: ...
            out.append((no, target))
    return out


def broken(path: Path) -> list[str]:
    problems = []
    for no, target in links(path):
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        where = f"{path.relative_to(REPO)}:{no}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with that anchor in {dest.relative_to(REPO)}")
        elif file_part.startswith("/"):
            problems.append(f"{where}: absolute path (breaks on GitHub and in a checkout)")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path: Path) -> None:
    assert not broken(path), "\n".join(broken(path))


def test_the_checker_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text(
        "# Title\n\n## The `x` section (two)\n\n"
        "[ok](b.md#b-heading) [ok](#the-x-section-two) [ok](a.md#title) [web](https://example.com)\n"
        "[gone](missing.md) [bad anchor](b.md#nope) `[in code](missing2.md)`\n"
        "```\n[in a fence](missing3.md)\n```\n"
    )
    (tmp_path / "b.md").write_text("# B heading\n")
    found = links(tmp_path / "a.md")
    assert [t for _, t in found] == [
        "b.md#b-heading", "#the-x-section-two", "a.md#title", "missing.md", "b.md#nope",
    ]  # fmt: skip
    assert anchors(tmp_path / "a.md") == {"title", "the-x-section-two"}


def test_repeated_headings_are_numbered(tmp_path: Path) -> None:
    (tmp_path / "r.md").write_text("# Notes\n## Notes\n## Notes\n")
    assert anchors(tmp_path / "r.md") == {"notes", "notes-1", "notes-2"}


def test_readme_is_a_front_page() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
