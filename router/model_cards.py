"""`GET /v1/models` bodies, in OpenAI's shape with vLLM's fields (`root`, `parent`,
`max_model_len`, `permission`)."""

from __future__ import annotations

import time
from typing import Any


def model_card(model: str, max_model_len: int) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "tandem",
        "root": model,
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


def models_body(model: str, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, max_model_len)]}
