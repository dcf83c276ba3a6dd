#!/usr/bin/env bash
# The GPU and 16-core checks as one script, for a lent offline GPU host (docs/gpu.md): the GPU
# tests, the KV-transfer and overhead benchmarks (issues 3 and 4) and the GPU check. Needs the
# wheels of scripts/device_wheelhouse.sh in .whl/serve. Each part has its own time limit, and its
# log goes to $OUT (or ./device-out), so a part that runs long costs only itself.
#   bash scripts/device_checks.sh [PARTS]   # PARTS: any of tests,kv,overhead,gpu (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device-out}
mkdir -p "$out"
parts=${1:-tests,kv,overhead,gpu}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/serve/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi -L; echo "cores: $(nproc)"; python3 -c 'import torch; print("torch", torch.__version__)'

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  [[ ",$parts," == *",$name,"* ]] || return 0
  echo "=== $name ($(date +%T), limit ${limit}s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -n 25
  echo "=== $name rc=${PIPESTATUS[0]} ($(date +%T))"
}
part tests 240 python3 -m pytest tests/gpu -q -p no:cacheprovider -rA --durations=5
part kv 240 python3 bench/kv_transfer.py --quick --transports shm,torch --wait-quiet 0
part overhead 130 python3 bench/overhead.py --requests 100
part gpu 100 python3 bench/gpu_check.py --quick --parts exactness,engine
