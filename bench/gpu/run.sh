#!/usr/bin/env bash
# The one command for a GPU machine:
#
#   bash bench/gpu/run.sh [OUT_DIR] [--wheelhouse DIR] [--dry-run]
#
# Runs every CUDA test (pytest -m cuda, which includes host registration
# through a real daemon's admission: tests/runtime/test_registration_wiring.py),
# bench/dlo_gpu.py (--quick sizes plus one 4 GiB disk-file registration, cold
# and pre-faulted) and the CUDA rows of bench/startup.py; JSON and logs go to
# OUT_DIR (default bench/results/gpu-<timestamp>), a summary table to stdout;
# the exit status is non-zero when any step or check failed. Budget: < 6
# minutes on one H200.
#
# Interpreter: the machine's own python3 with PYTHONPATH=. when the project's
# dependencies import; else, with --wheelhouse DIR, `.ci/setup --wheelhouse
# DIR` builds .venv offline and that is used; else an existing .venv.
# --dry-run prints the plan and imports everything, runs nothing CUDA, exit 0.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT="" WHEELHOUSE="" DRY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY="--dry-run"; shift ;;
    --wheelhouse) WHEELHOUSE="${2:?--wheelhouse needs a directory}"; shift 2 ;;
    --wheelhouse=*) WHEELHOUSE="${1#*=}"; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    -*) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [ -z "$OUT" ] || { echo "run.sh: one OUT_DIR only" >&2; exit 2; }; OUT="$1"; shift ;;
  esac
done
OUT="${OUT:-bench/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}"
export PYTHONPATH=.

# What the run imports: if these fail, the interpreter cannot run the plan.
# The generated stubs are imported too: an older protobuf/grpcio than they
# need fails there, not at `import grpc`.
PROBE="import torch, grpc, google.protobuf, grpc_health.v1, pytest, hwr_client.client, hwr_client.core._proto.hwr_pb2_grpc, hwr_client.registration, hwr_server, dlo_runtime"
PY=""
if [ -n "$WHEELHOUSE" ]; then
  # Offline install (no registry): .ci/setup owns how; we only call it.
  bash .ci/setup --wheelhouse "$WHEELHOUSE"
  PY=.venv/bin/python
elif python3 -c "$PROBE" 2>/dev/null; then
  PY=python3
elif [ -x .venv/bin/python ] && .venv/bin/python -c "$PROBE" 2>/dev/null; then
  PY=.venv/bin/python
else
  echo "run.sh: python3 lacks the project's dependencies:" >&2
  python3 -c "$PROBE" 2>&1 | tail -1 >&2 || true
  echo "run.sh: rerun with --wheelhouse DIR (built by: bash .ci/wheelhouse DIR)" >&2
  exit 3
fi
echo "run.sh: interpreter $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))"
if [ -z "$DRY" ]; then
  exec "$PY" bench/gpu/runner.py "$OUT" --python "$PY"
fi
"$PY" bench/gpu/runner.py "$OUT" --python "$PY" --dry-run
# Name the CUDA tests of the registration-admission path (daemon budget ->
# chunked cudaHostRegister -> release), so a plan without them shows.
ADMISSION=$("$PY" -m pytest -q -p no:cacheprovider --collect-only -m cuda tests/runtime/test_registration_wiring.py \
  | grep '::' || true)
if [ -z "$ADMISSION" ]; then
  echo "run.sh: no cuda test of the registration-admission path collected (tests/runtime/test_registration_wiring.py)" >&2
  exit 1
fi
echo "registration admission path (in pytest_cuda):"
echo "$ADMISSION" | sed 's/^/  /'
