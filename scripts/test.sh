#!/usr/bin/env bash
# The test command (README, CI): set up, start the real local stack, lint, type-check, test.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m unit` (the quick tier: no servers, no
# stack started, no Kubernetes build) or `scripts/test.sh -k store`.  The tiers: docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
# `-m unit` alone selects tests that need no server: skip the Kubernetes build and the stack.
unit_only=0
case " $* " in *" -m unit "*) unit_only=1 ;; esac
if [ "$unit_only" = 1 ]; then
  bash scripts/setup.sh
else
  # The Kubernetes control plane too: the Kubernetes executor's tests run on it.
  TRAINGUARD_SETUP_K8S=1 bash scripts/setup.sh
fi
export PATH="$PWD/.venv/bin:$PATH"
# The checkout's own stack home (its servers, keys and state stay here, as they always did) unless
# the caller names one; `trainguard` run by hand elsewhere defaults to ~/.local/share/trainguard.
export TRAINGUARD_HOME="${TRAINGUARD_HOME:-$PWD/.trainguard}"
if [ "$unit_only" = 0 ]; then
  trainguard stack up
  # CI leaves nothing running behind it; a developer keeps the stack for the next run.
  if [ "${CI:-}" = "true" ]; then trap 'trainguard stack down || true' EXIT; fi
fi
ruff check .
ruff format --check .
mypy
lint-imports --no-cache
# The 30 slowest tests at the end of the output: where CI's time goes (pytest's own report).
pytest --durations=30 "$@"
