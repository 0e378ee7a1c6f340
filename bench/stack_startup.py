"""Benchmark: `stack up` time -- cold (fresh home), warm (already running), restart (data kept).

Runs a private stack in a temporary home on its own ports, so a running dev stack is untouched.
`--fresh-jar-cache` also measures resolving the broker's jars with Maven into an empty cache
(Maven's own ~/.m2 repository still serves them offline after the first ever run).

    python bench/stack_startup.py [--fresh-jar-cache]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from trainguard.infra.config import load_settings
from trainguard.infra.stack.manager import Stack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fresh-jar-cache", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as cache:
        env = {
            "TRAINGUARD_HOME": home,
            "TRAINGUARD__STACK__KAFKA_PORT": "39092",
            "TRAINGUARD__STACK__KAFKA_CONTROLLER_PORT": "39093",
            "TRAINGUARD__STACK__CLICKHOUSE_HTTP_PORT": "38123",
            "TRAINGUARD__STACK__CLICKHOUSE_TCP_PORT": "39000",
        }
        if args.fresh_jar_cache:
            env["TRAINGUARD__STACK__CACHE_DIR"] = cache
        stack = Stack(load_settings(environ=env))
        try:
            rows = []
            t0 = time.perf_counter()
            stack.up()
            rows.append(
                (
                    "cold (fresh home" + (", empty jar cache)" if args.fresh_jar_cache else ")"),
                    time.perf_counter() - t0,
                )
            )
            t0 = time.perf_counter()
            stack.up()
            rows.append(("warm (already running)", time.perf_counter() - t0))
            stack.down()
            t0 = time.perf_counter()
            stack.up()
            rows.append(("restart (stopped, data kept)", time.perf_counter() - t0))
        finally:
            stack.down()
    print("trainguard stack up timings (2-core machine)")
    for name, secs in rows:
        print(f"  {name:40} {secs:6.2f} s")


if __name__ == "__main__":
    main()
