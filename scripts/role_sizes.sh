#!/usr/bin/env bash
# Install each deployment role of TrainGuard into a fresh virtualenv under /tmp from this checkout
# and print the size of its site-packages (the README's role table).  Uses pip's cache.
set -u
cd "$(dirname "$0")/.."
here=$PWD
PY=${PYTHON:-python3.11}
for role in base node demo; do
  d=/tmp/trainguard-role-$role; rm -rf "$d"; "$PY" -m venv "$d"
  case $role in
    base) spec=("$here") ;;
    node) spec=("$here[node]") ;;
    demo) spec=("$here[node]" "$here/demo") ;;
  esac
  "$d/bin/pip" install -q "${spec[@]}" > "$d.log" 2>&1 || { echo "$role: install failed, see $d.log"; continue; }
  sp=$("$d/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  torch=$("$d/bin/python" -c 'import importlib.util as u; print("torch" if u.find_spec("torch") else "no torch")')
  echo "$role: $(du -sm "$sp" | cut -f1) MB site-packages ($torch)"
  rm -rf "$d"
done
