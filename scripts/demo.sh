#!/usr/bin/env bash
# The main job (README): set up, start the real local stack, and run the end-to-end demo: a real
# PyTorch job on a local cluster of 4 machines + warm standbys survives injected faults; the
# timeline and the ETTR are printed at the end (12.7-13.2 minutes a run on 2 cores; the setup
# installs only what the demo uses: the Kubernetes control plane is built by the test command or
# on the first `trainguard stack up --k8s`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
# The checkout's own stack home (its servers, keys and state stay here, as they always did) unless
# the caller names one; `trainguard` run by hand elsewhere defaults to ~/.local/share/trainguard.
export TRAINGUARD_HOME="${TRAINGUARD_HOME:-$PWD/.trainguard}"
trainguard stack up
trainguard stack status
trainguard smoke
trainguard demo --summary-json "$TRAINGUARD_HOME/demo-summary.json" "$@"
