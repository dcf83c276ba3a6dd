#!/usr/bin/env bash
# Sets up the environment, builds the embedded tiny model once, and runs the main job on it.
# Until the Ray cluster lands this is offline generation with `tandem.LLM` (`tandem generate`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
model=.tandem/models/tiny-llama
if [ ! -f "$model/config.json" ]; then
  .venv/bin/tandem tiny-model "$model" --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 512 --seed 0
fi
exec .venv/bin/tandem generate --model "$model" "$@"
