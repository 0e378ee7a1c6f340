"""Reading a recorded Flight Recorder fixture set (a folder of cases, each with a ``manifest.json``
naming its topology and dump times, and its dumps per format) for the analysis tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainguard.detectors.flight_recorder import analyze_dumps, load_dump_dir
from trainguard.schemas.topology import JobTopology


def cases(fixtures: Path) -> list[str]:
    return sorted(p.name for p in fixtures.iterdir() if (p / "manifest.json").exists())


def analyze_case(fixtures: Path, name: str, fmt: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the case's manifest, the analysis of its ``fmt`` dumps at their recorded dump times)."""
    manifest = json.loads((fixtures / name / "manifest.json").read_text())
    topology = JobTopology(job=name, **manifest["topology"])
    dumps = load_dump_dir(fixtures / name / fmt)
    dump_ns = {int(r): ns for r, ns in manifest["dumped_at_ns"][fmt].items()}
    return manifest, analyze_dumps(dumps, topology, dump_ns).to_dict()
