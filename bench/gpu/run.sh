#!/usr/bin/env bash
# The one command of the first GPU run (issue 23; docs/gpu.md):
#
#   bash bench/gpu/run.sh OUT [--dry-run] [--wheels DIR]
#
# On the lent GPU image (x86-64, python3 = Python 3.12 with its own torch,
# no diffusers, no grpcio-health-checking, nothing fetchable), in at most 5
# minutes: installs the carried cp312 wheels the image lacks or has too old
# (DIR, default .whl, built on a machine with an index by
# `python bench/gpu/wheels.py build .whl` from bench/gpu/wheels.lock) with
# pip --no-index --no-deps --target into a temporary directory appended to
# PYTHONPATH after the repository; then bench/gpu/runner.py runs: versions
# and the GPU's capability row + the probe matrix (bench/gpu/probe.py),
# pytest -m cuda -rs, bench/dlo_gpu.py --quick and bench/startup.py's CUDA
# rows. OUT receives gpu.json (everything) and gpu.log; the summary goes to
# stdout; the exit status is non-zero when any step or check failed.
# --dry-run (CPU, CI) imports everything and collects the CUDA tests.
#
# The interpreter is $PYTHON, else python3 (the image's, which holds torch:
# never a venv of our own, which would not see it).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD

OUT="" DRY="" WHEELS=.whl
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY="--dry-run"; shift ;;
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift 2 ;;
    --wheels=*) WHEELS="${1#*=}"; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    -*) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [ -z "$OUT" ] || { echo "run.sh: one OUT only" >&2; exit 2; }; OUT="$1"; shift ;;
  esac
done
[ -n "$OUT" ] || { echo "run.sh: usage: bash bench/gpu/run.sh OUT [--dry-run] [--wheels DIR]" >&2; exit 2; }
PY=${PYTHON:-python3}

SITE=""
if [ -d "$WHEELS" ]; then
  SITE=$(mktemp -d "${TMPDIR:-/tmp}/hwr-gpu-site.XXXXXX")
  trap 'rm -rf "$SITE"' EXIT
  # Only what this interpreter lacks or has too old (bench/gpu/wheels.lock).
  PYTHONPATH="$REPO" "$PY" bench/gpu/wheels.py install "$WHEELS" "$SITE"
fi
# Appended, never replaced: the repository first, then the carried wheels,
# then whatever PYTHONPATH the image sets; all before its site-packages.
export PYTHONPATH="$REPO${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"

# What the run imports: if these fail, the interpreter cannot run the plan.
# The generated stubs are imported too: an older protobuf/grpcio than they
# need fails there, not at `import grpc`.
PROBE="import torch, grpc, google.protobuf, grpc_health.v1, pytest, hwr_client.client, hwr_client.core._proto.hwr_pb2_grpc, hwr_client.registration, hwr_server, dlo_runtime"
if ! "$PY" -c "$PROBE" 2>/dev/null; then
  echo "run.sh: $PY lacks the project's dependencies:" >&2
  "$PY" -c "$PROBE" 2>&1 | tail -1 >&2 || true
  echo "run.sh: carry the wheels: python bench/gpu/wheels.py build $WHEELS (then name $WHEELS in carry)" >&2
  exit 3
fi
echo "run.sh: $("$PY" -c 'import sys, torch; print(sys.executable, sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)')"
rc=0
"$PY" bench/gpu/runner.py "$OUT" --python "$PY" $DRY || rc=$?
exit $rc
