#!/usr/bin/env bash
# Install each deployment role of TrainGuard into a fresh virtualenv under /tmp from this checkout
# (the exact versions of constraints.txt, pip's cache warm) and print, per role, the size of its
# site-packages and the import closure of what that role runs: how many modules load, and which of
# the heavy ones.  Usage: bash scripts/role_sizes.sh [ROLE ...]  (default: every role but demo).
set -u
cd "$(dirname "$0")/.."
here=$PWD
PY=${PYTHON:-python3.11}
roles=("$@")
[ ${#roles[@]} -gt 0 ] || roles=(base node worker actions store report all)
heavy='faust aiokafka kafka clickhouse_connect plotly sklearn numpy torch prometheus_client pynvml kubernetes cryptography'
for role in "${roles[@]}"; do
  d=/tmp/trainguard-role-$role; rm -rf "$d"; "$PY" -m venv "$d"
  case $role in
    base) spec=("$here"); probe='import trainguard.training' ;;
    node) spec=("$here[node]"); probe='import trainguard.commands.exporter, trainguard.streams.exporter.service' ;;
    worker) spec=("$here[worker,store]"); probe='import trainguard.commands.worker, trainguard.streams.app, trainguard.infra.sink' ;;
    actions) spec=("$here[actions]"); probe='import trainguard.commands.actions, trainguard.actions.service' ;;
    store) spec=("$here[store]"); probe='import trainguard.commands.sql, trainguard.infra.clickhouse.store' ;;
    report) spec=("$here[report]"); probe='import trainguard.commands.report, trainguard.infra.report.render' ;;
    all) spec=("$here[all]"); probe='import trainguard.cli' ;;
    demo) spec=("$here[all]" "$here/demo"); probe='import trainguard_demo.commands' ;;
    *) echo "$role: unknown role"; continue ;;
  esac
  "$d/bin/pip" install -q -c "$here/constraints.txt" "${spec[@]}" > "$d.log" 2>&1 \
    || { echo "$role: install failed, see $d.log"; continue; }
  sp=$("$d/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # The probe runs outside the checkout, so only what was installed can load.
  closure=$(cd /tmp && "$d/bin/python" -c "
import sys
before = set(sys.modules)
$probe
loaded = set(sys.modules) - before
tops = sorted({m.split('.')[0] for m in loaded} & set('$heavy'.split()))
print(f'{len(loaded)} modules; heavy: {\", \".join(tops) or \"none\"}')
" 2>&1 | tail -1)
  echo "$role: $(du -sm "$sp" | cut -f1) MB site-packages; \`$probe\`: $closure"
  rm -rf "$d" "$d.log"
done
