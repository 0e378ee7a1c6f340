#!/usr/bin/env bash
# One prepared run of `trainguard diag` on a GPU machine, every output under "$OUT/".
#
#   OUT=/some/dir scripts/device_diag.sh        # from anywhere; it works in the repository root
#
# What it writes:
#   nvidia-smi-q.txt, nvidia-smi.txt, nvidia-smi-topo.txt   the machine as the driver sees it
#   python.txt          which Python ran, torch / CUDA / pynvml versions, how trainguard was found
#   setup.log           the virtualenv and pip steps (when any were needed)
#   diag.jsonl          `trainguard diag --level $DIAG_LEVEL --json` (JSON lines, one per test)
#   diag.stderr.txt     its progress lines;  diag.rc: its exit status (0 ok/skipped, 1 failed, 2 usage)
#   digest-rerun.jsonl  gemm-digest again in a fresh process, checked against the first run's digest
#   collective-nccl.jsonl  the collective test with NCCL by name (a one-GPU machine's level run uses gloo)
#   exporter.jsonl      `trainguard exporter --once --print`: one round of every exporter source
#   summary.txt         one line per step and per test
#
# Python: the machine may have no internet.  A system python3 that already imports torch is used
# as is (in a venv with --system-site-packages, so its torch and CUDA libraries are kept); the
# project's own small dependencies are installed into that venv if the package index answers, and
# otherwise the working tree is imported through PYTHONPATH (diag needs only click and PyYAML
# beside torch; without pynvml, gpu-health reports itself skipped).  Without a system torch it
# falls back to `pip install -c constraints.txt -e .[node] torch` in a fresh venv (several GB).
#
# Exit status: diag's (0, 1 or 2); 3 when no Python with the project's imports could be set up.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
: "${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
LEVEL=${DIAG_LEVEL:-standard}
VENV=${DIAG_VENV:-/tmp/v}
WORK=$(mktemp -d /tmp/trainguard-device-diag.XXXXXX)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
# pip fails fast where there is no network, instead of retrying for minutes.
PIP_FLAGS=(--disable-pip-version-check --retries 1 --timeout 15)

note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME TIMEOUT_S OUTFILE CMD...: run, keep stdout/stderr/rc, never stop the script
  local name=$1 limit=$2 out=$3; shift 3
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$out" 2> "${out%.*}.stderr.txt"
  local rc=$?
  echo "$rc" > "${out%.*}.rc"
  note "$name: exit $rc in $((SECONDS - t0)) s"
  return $rc
}

# -- 1. the machine, before anything can fail --------------------------------------------------------
step "nvidia-smi -q" 60 "$OUT/nvidia-smi-q.txt" nvidia-smi -q
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
nvidia-smi topo -m > "$OUT/nvidia-smi-topo.txt" 2>&1
note "dcgmi: $(command -v dcgmi || echo 'not installed')"
note "all_reduce_perf: $(command -v all_reduce_perf || echo 'not installed')"

# -- 2. a Python that imports torch and the project ---------------------------------------------------
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # the working tree's trainguard, installed or not
PY=""
{
  if command -v python3 > /dev/null && python3 -c "import torch" 2> /dev/null; then
    echo "system python3 has torch: $(python3 -c 'import torch; print(torch.__version__)')"
    if python3 -m venv --system-site-packages "$VENV"; then
      PY="$VENV/bin/python"
      # The project's small dependencies (click, PyYAML, nvidia-ml-py, the exporter's kafka-python,
      # orjson, cryptography, prometheus-client): the exact versions of constraints.txt.
      timeout 300 "$PY" -m pip install "${PIP_FLAGS[@]}" -q -c constraints.txt -e ".[node]" \
        || echo "pip install -e .[node] failed (no index?): using the system's packages and PYTHONPATH"
    else
      PY=python3
      echo "python3 -m venv failed: using python3 itself with PYTHONPATH"
    fi
  elif command -v python3 > /dev/null; then
    echo "no system torch: a fresh venv with torch from the index (several GB)"
    python3 -m venv "$VENV" \
      && timeout 900 "$VENV/bin/pip" install "${PIP_FLAGS[@]}" -q -c constraints.txt -e ".[node]" torch \
      && PY="$VENV/bin/python"
  fi
} > "$OUT/setup.log" 2>&1
if [ -z "$PY" ] || ! "$PY" -c "import click, yaml, trainguard.diag" >> "$OUT/setup.log" 2>&1; then
  note "setup: no Python with torch, click, PyYAML and trainguard (see setup.log)"
  exit 3
fi
"$PY" - > "$OUT/python.txt" 2>&1 << 'EOF'
import sys, importlib.metadata as md
import trainguard
print("python", sys.version.split()[0], sys.executable)
print("trainguard from", trainguard.__file__)
eps = {e.name for e in md.entry_points(group="trainguard.commands")}
print("entry points: diag", "diag" in eps, "exporter", "exporter" in eps)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          "devices", torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if torch.cuda.is_available():
        print("nccl", torch.cuda.nccl.version(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
except Exception as exc:
    print("torch:", exc)
try:
    import pynvml
    print("pynvml", md.version("nvidia-ml-py"))
except Exception as exc:
    print("pynvml:", exc)
EOF
cat "$OUT/python.txt" >> "$SUMMARY"

# `python -m trainguard CMD` where the entry points are installed; otherwise the command object.
has_entry_point() {
  "$PY" -c "import sys, importlib.metadata as m; sys.exit(0 if '$1' in {e.name for e in m.entry_points(group='trainguard.commands')} else 1)"
}
if has_entry_point diag; then
  DIAG=("$PY" -m trainguard diag)
else
  DIAG=("$PY" -c "from trainguard.commands.diag import diag; diag(prog_name='trainguard diag')")
fi
if has_entry_point exporter; then
  EXPORTER=("$PY" -m trainguard exporter)
else
  EXPORTER=("$PY" -c "from trainguard.commands.exporter import exporter; exporter(obj={}, prog_name='trainguard exporter')")
fi

summarize() {  # one line per test of a diag JSON-lines file, findings below it
  "$PY" - "$1" >> "$SUMMARY" 2>&1 << 'EOF'
import json, sys
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    word = {True: "PASS", False: "FAIL", None: "SKIP"}[r["passed"]]
    print(f"  {word} {r['test']:<12} {r['duration_s']:7.1f} s  {r['skipped_reason'] or ''}")
    for f in r["findings"]:
        print(f"       - {f}")
EOF
}

# -- 3. the diag run ----------------------------------------------------------------------------------
# External tools get bounded times here, so the whole script fits one device call.
step "diag --level $LEVEL" 480 "$OUT/diag.jsonl" "${DIAG[@]}" --level "$LEVEL" --json \
  --set dcgm.timeout_s=240 --set nccl_tests.timeout_s=180 --set nccl_tests.max_bytes=1G
DIAG_RC=$(cat "$OUT/diag.rc")
summarize "$OUT/diag.jsonl"

# The digest again, from a fresh process: the same GPU must give the same bits (silent corruption
# or a nondeterministic kernel otherwise).  Same level, so the same sizes.
DIGEST=$("$PY" -c "
import json, sys
for line in open(sys.argv[1]):
    if line.startswith('{'):
        r = json.loads(line)
        if r['test'] == 'gemm-digest' and r['measured'].get('devices') and 'digest' in r['measured']['devices'][0]:
            print(r['measured']['devices'][0]['digest'])
" "$OUT/diag.jsonl" 2> /dev/null)
if [ -n "$DIGEST" ]; then
  step "gemm-digest rerun vs $DIGEST" 240 "$OUT/digest-rerun.jsonl" "${DIAG[@]}" --level "$LEVEL" --json \
    --test gemm-digest --expected-digest "$DIGEST"
  summarize "$OUT/digest-rerun.jsonl"
else
  note "gemm-digest rerun: no digest in the first run"
fi

# NCCL by name: with one GPU the level's collective runs gloo on the CPU; this checks NCCL's path.
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2> /dev/null; then
  step "collective with NCCL" 180 "$OUT/collective-nccl.jsonl" "${DIAG[@]}" --level "$LEVEL" --json \
    --test collective --set collective.backend=nccl
  summarize "$OUT/collective-nccl.jsonl"
else
  note "collective with NCCL: torch sees no GPU"
fi

# -- 4. one round of the node exporter ----------------------------------------------------------------
mkdir -p "$WORK/state"
step "exporter --once --print" 120 "$OUT/exporter.jsonl" "${EXPORTER[@]}" --node device-diag --job diag \
  --socket "$WORK/reporter.sock" --state-dir "$WORK/state" --once --print
"$PY" -c "
import json, sys
kinds = {}
for line in open(sys.argv[1]):
    if line.startswith('{'):
        kind = json.loads(line).get('schema', '?')
        kinds[kind] = kinds.get(kind, 0) + 1
print('  exporter events:', kinds)
" "$OUT/exporter.jsonl" >> "$SUMMARY" 2>&1

rm -rf "$WORK"
exit "$DIAG_RC"
