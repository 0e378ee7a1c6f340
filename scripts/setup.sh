#!/usr/bin/env bash
# Sets up everything TrainGuard needs on a fresh Debian machine (idempotent, quick when done):
# system packages (Java 17 + Maven for the Kafka broker, Debian's clickhouse-server, zookeeper for the
# cluster stack's ClickHouse replicas, slurm-wlm + munge for the optional local Slurm, prometheus and chromium for the tests, python3-venv),
# then a virtualenv in .venv with every role of the project at the exact versions of constraints.txt
# (pip's cache is kept, so the multi-GB torch wheel is downloaded once per machine).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || need+=(maven)
command -v clickhouse-server >/dev/null 2>&1 || need+=(clickhouse-server clickhouse-client)
# ZooKeeper coordinates the replicas of `trainguard stack up --cluster` (ClickHouse 18.16 has no
# Keeper); a jar under /usr/share/java, run by the stack itself (Debian starts no service of it).
[ -f /usr/share/java/zookeeper.jar ] || need+=(zookeeper)
# Slurm + munge for `trainguard stack up --slurm` (the daemons live in /usr/sbin, often not on PATH).
command -v slurmd >/dev/null 2>&1 || [ -x /usr/sbin/slurmd ] || need+=(slurm-wlm munge)
# promtool (tests the shipped alert rules) and a real Prometheus (scrapes a worker and an exporter
# in a test); chromium renders the HTML postmortem report in its browser test.
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1; then PY=$cand; break; fi
  done
fi
[ -n "$PY" ] || need+=(python3 python3-venv)
if [ -n "$PY" ] && ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then need+=(python3-venv); fi

if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing system packages: ${need[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${need[@]}"
  PY=${PY:-python3}
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PY"
  "$PY" -m venv .venv
fi
# Reinstall only when the dependency spec changed.
stamp=.venv/.trainguard-installed
want=$(cat pyproject.toml demo/pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing Python dependencies (first run downloads torch: several GB, cached by pip)"
  .venv/bin/python -m pip install -q --upgrade pip
  # Every role at once for a developer: the product with all its extras, the test tools, and the
  # demo (its own distribution beside the product; it brings torch), at the versions CI uses.
  # The deprecated `pynvml` shim (replaced by nvidia-ml-py, which provides the same module) goes
  # if an older setup left it: both ship pynvml.py, so nvidia-ml-py is reinstalled after it.
  if .venv/bin/python -m pip show -q pynvml >/dev/null 2>&1; then
    .venv/bin/python -m pip uninstall -q -y pynvml nvidia-ml-py
  fi
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[all,dev]" -e ./demo
  echo "$want" > "$stamp"
fi
# The Kubernetes control plane of `trainguard stack up --k8s` (and its tests), built from Go modules
# once per machine into ~/.cache/trainguard (minutes cold; a no-op once built).  Only when asked
# (TRAINGUARD_SETUP_K8S=1: the test command): the default demo never uses it, and on a fresh
# machine it was 6.3 of the demo command's 19.5 minutes.  `stack up --k8s` builds it on first use.
if [ "${TRAINGUARD_SETUP_K8S:-0}" = 1 ]; then
  if command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then
    .venv/bin/python -m trainguard.infra.stack.k8s --build
  else
    echo "setup: no Go toolchain: the Kubernetes control plane (stack up --k8s) is not built"
  fi
fi
echo "setup: ready (.venv/bin/trainguard)"
