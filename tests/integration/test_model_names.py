"""The names the cluster serves (conftest's "tiny" and "tiny-alias"): `/v1/models` lists a
card per name rooted at the checkpoint, each is a request's model, replies carry the first."""

from __future__ import annotations

import requests

from tests.integration.test_bad_input_http import assert_error


def test_a_model_card_is_retrieved_by_name(base_url: str) -> None:
    card = requests.get(f"{base_url}/v1/models/tiny", timeout=30)
    assert card.status_code == 200, card.text
    assert card.json()["id"] == "tiny" and card.json()["object"] == "model"
    missing = requests.get(f"{base_url}/v1/models/org/other-model", timeout=30)
    assert_error(missing, 404, "model")
    listed = requests.get(f"{base_url}/v1/models/", timeout=30)  # (a trailing slash)
    assert listed.status_code == 200, listed.text
    cards = listed.json()["data"]
    assert [c["id"] for c in cards] == ["tiny", "tiny-alias"]
    # (each card's root is the checkpoint it serves, as vLLM's `--model` path)
    assert {c["root"] for c in cards} == {card.json()["root"]} and "/" in card.json()["root"]


def test_a_second_served_name_is_served_and_answered_as_the_first(base_url: str) -> None:
    body = {"model": "tiny-alias", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    resp = requests.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "tiny"  # (vLLM's replies name the first served name)
    alias = requests.get(f"{base_url}/v1/models/tiny-alias", timeout=30)
    assert alias.status_code == 200 and alias.json()["id"] == "tiny-alias", alias.text
    unknown = requests.post(
        f"{base_url}/v1/completions", json={**body, "model": "tiny-"}, timeout=30
    )
    assert_error(unknown, 404, "model")
    assert "`tiny`, `tiny-alias`" in unknown.json()["error"]["message"]
