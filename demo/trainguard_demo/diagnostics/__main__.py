"""``python -m trainguard_demo.diagnostics``: run one stop-time test here, or the test server.

``alignment`` / ``connectivity --rank R --world 2 --port P`` print one JSON object; ``serve`` forks
the tests asked for on stdin (JSON lines), as :mod:`.server` describes.
"""

from __future__ import annotations

import argparse
import json
import sys

from trainguard_demo.diagnostics.server import serve
from trainguard_demo.diagnostics.tests import alignment_digest, connectivity_check


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trainguard_demo.diagnostics", description=__doc__.splitlines()[0].strip("`")
    )
    sub = p.add_subparsers(dest="test", required=True)
    a = sub.add_parser("alignment", help="print the reference step's parameter digest")
    a.add_argument("--perturb", action="store_true", help="inject a one-ulp arithmetic fault")
    c = sub.add_parser("connectivity", help="gloo all-gather with peers on 127.0.0.1")
    c.add_argument("--rank", type=int, required=True)
    c.add_argument("--world", type=int, required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--timeout", type=float, default=20.0)
    c.add_argument("--corrupt", action="store_true", help="send a corrupted payload")
    sub.add_parser("serve", help="fork the tests asked for on stdin (JSON lines); used by run_local")
    ns = p.parse_args(argv)
    if ns.test == "serve":
        return serve()
    if ns.test == "alignment":
        print(json.dumps({"ok": True, "digest": alignment_digest(ns.perturb)}))
    else:
        print(json.dumps(connectivity_check(ns.rank, ns.world, ns.port, ns.timeout, ns.corrupt)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
