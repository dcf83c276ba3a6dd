#!/usr/bin/env bash
# Writes deploy/constraints-cuda.txt: the versions deploy/Dockerfile's VARIANT=cuda image
# installs (torch's default CUDA wheel, tandem with its gpu and ucx-cu13 extras), as pip
# resolves them now from PyPI. scripts/constraints.txt cannot serve there: it was frozen beside
# torch's CPU build and pins CUDA 12 bindings and a triton that torch's CUDA build refuses.
# Resolves only (pip --dry-run): nothing is downloaded but package metadata. Needs PyPI.
# Run from the repository root after scripts/setup_env.sh, when scripts/constraints.txt moves.
set -euo pipefail
cd "$(dirname "$0")/.."
report=$(mktemp)
trap 'rm -f "$report"' EXIT
torch_version=$(sed -n 's/^ARG TORCH_VERSION=//p' deploy/Dockerfile)
# The versions the tests passed with, except what the CUDA build of torch decides itself.
cpu_pins=$(mktemp)
grep -v -E '^(triton|cuda-|nvidia-|ucxx-|libucxx-|libucx-|rmm-|librmm-)' scripts/constraints.txt > "$cpu_pins"
.venv/bin/python -m pip --isolated install --quiet --dry-run --ignore-installed \
  --index-url https://pypi.org/simple --report "$report" \
  "torch==${torch_version}" ".[gpu,ucx-cu13]" -c "$cpu_pins"
rm -f "$cpu_pins"
{
  echo "# Versions of deploy/Dockerfile's VARIANT=cuda image (written by"
  echo "# scripts/freeze_cuda_constraints.sh from scripts/constraints.txt and torch==${torch_version}'s"
  echo "# CUDA wheel; the Dockerfile installs with -c this file). torch has its own pin."
  .venv/bin/python - "$report" <<'PY'
import json
import sys

report = json.load(open(sys.argv[1]))
pins = sorted(
    (item["metadata"]["name"], item["metadata"]["version"])
    for item in report["install"]
    if item["metadata"]["name"].lower() not in ("torch", "tandem-serve")
)
for name, version in pins:
    print(f"{name}=={version}")
PY
} > deploy/constraints-cuda.txt
echo "wrote deploy/constraints-cuda.txt ($(grep -c '==' deploy/constraints-cuda.txt) pins)"
