#!/usr/bin/env bash
# Sets up the environment, then serves the embedded tiny model on a local Ray cluster
# (1 prefill + 1 decode worker; OpenAI API on http://127.0.0.1:8000/v1). Extra arguments go to
# `tandem serve` (see `.venv/bin/tandem serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-.tandem}
exec .venv/bin/tandem serve "$@"
