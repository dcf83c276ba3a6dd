"""`GET /v1/models` bodies, in OpenAI's shape with vLLM's fields (`root`: the checkpoint the
name serves, `parent`, `max_model_len`, `permission`): one card per served name."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


def model_card(model: str, root: str, max_model_len: int) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "tandem",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [  # (vLLM's card has one, with these values)
            {
                "id": f"modelperm-{model}",
                "object": "model_permission",
                "created": int(time.time()),
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def models_body(models: Sequence[str], root: str, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(m, root, max_model_len) for m in models]}
