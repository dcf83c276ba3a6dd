"""Decode throughput: tandem (continuous batching) vs Hugging Face static batching, same model.

Reuses the engine benchmark (`bench/engine_throughput.py --quick --skip-overhead`) in a
subprocess and keeps its float32 figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run(wait_quiet_s: float = 0.0) -> dict[str, Any]:
    cmd = [sys.executable, str(REPO / "bench" / "engine_throughput.py"), "--quick",
           "--skip-overhead", "--dtype", "float32", "--wait-quiet", str(wait_quiet_s)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    fp32 = summary["dtypes"]["float32"]
    return {
        "command": " ".join(["python", *cmd[1:]]).replace(str(REPO) + "/", ""),
        "model_parameters": summary["model"]["parameters"],
        "workload": summary["workload"],
        "tandem_tok_s": fp32["tandem"]["tok_s"],
        "hf_tok_s": fp32["hf"]["tok_s"],
        "ratio": fp32["ratio"],
        "spot_check_passed": fp32["spot_check"]["passed"],
        "others_cpu": [fp32["tandem"]["others_cpu"], fp32["hf"]["others_cpu"]],
    }
