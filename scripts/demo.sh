#!/usr/bin/env bash
# The main job (README): set up, start the real local stack, and run the end-to-end smoke run
# (events through Kafka into ClickHouse, then a postmortem query).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
trainguard stack up
trainguard stack status
trainguard smoke "$@"
