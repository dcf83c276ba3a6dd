"""The chart's values schema holds, for every block it forwards into the cluster config, the
schema of the model that reads it (`tandem.deploy.helm_schema`): regenerated, it is unchanged."""

from __future__ import annotations

import json

from tandem.deploy import helm_schema
from tandem.engine.config import EngineConfig


def test_the_committed_schema_is_up_to_date() -> None:
    assert helm_schema.main(["--check"]) == 0, "run: python -m tandem.deploy.helm_schema"


def test_forwarded_blocks_are_closed_and_complete() -> None:
    schema = json.loads(helm_schema.SCHEMA_FILE.read_text())
    serve = schema["properties"]["serve"]["properties"]
    engine = serve["engine"]
    assert engine["additionalProperties"] is False
    assert set(engine["properties"]) == set(EngineConfig.model_fields) - {"model", "tokenizer"}
    assert "auto" in engine["properties"]["dtype"]["enum"]
    decode = schema["properties"]["decode"]["properties"]
    kv_target = decode["autoscaling"]["properties"]["kv_usage_target"]["anyOf"][0]
    assert kv_target["maximum"] == 1
    for path in helm_schema.generated_parts():
        node = schema
        for name in path:
            node = node["properties"][name]
        assert node["additionalProperties"] is False, path
