#!/usr/bin/env bash
# Creates .venv (if needed) and installs torch==2.13.0 first, then tandem with its dev extras.
# Versions are those of scripts/constraints.txt (the set the tests last passed with).
# Idempotent: re-installs only when pyproject.toml or the constraints changed since the last
# successful run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating virtual environment in .venv"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.tandem-installed
want=$(cat pyproject.toml scripts/constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing torch==2.13.0 (CPU build) and tandem-serve[dev]"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt -e '.[dev]'
  echo "$want" > "$stamp"
fi
