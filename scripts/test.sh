#!/usr/bin/env bash
# The test command (README, CI): set up, start the real local stack, lint, type-check, test.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` or `scripts/test.sh -k store`.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Kubernetes control plane too: the Kubernetes executor's tests run on it.
TRAINGUARD_SETUP_K8S=1 bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
# The checkout's own stack home (its servers, keys and state stay here, as they always did) unless
# the caller names one; `trainguard` run by hand elsewhere defaults to ~/.local/share/trainguard.
export TRAINGUARD_HOME="${TRAINGUARD_HOME:-$PWD/.trainguard}"
trainguard stack up
# CI leaves nothing running behind it; a developer keeps the stack for the next run.
if [ "${CI:-}" = "true" ]; then trap 'trainguard stack down || true' EXIT; fi
ruff check .
ruff format --check .
mypy
lint-imports --no-cache
pytest "$@"
