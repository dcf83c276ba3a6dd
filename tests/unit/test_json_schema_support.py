"""A JSON schema some of which the grammar would not enforce is refused (its output could break
it while finishing "stop"), offline and through the API; a tool's parameters are not held to it."""

from __future__ import annotations

import datetime
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field

from tandem import LLM, SamplingParams
from tandem.engine.errors import InvalidRequestError
from tandem.engine.json_schema_support import unenforced
from tandem.router.errors import APIError
from tandem.router.structured_output import one_structure


class Address(BaseModel):
    street: str
    zip: str = Field(pattern=r"^\d{5}$")


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=150)
    email: str | None = None
    born: datetime.date
    tags: list[str] = Field(min_length=1, max_length=5)
    kind: Literal["a", "b"]
    home: Address
    score: float


class Cat(BaseModel):
    pet_type: Literal["cat"]
    meows: int


class Dog(BaseModel):
    pet_type: Literal["dog"]
    barks: float


class Owner(BaseModel):
    pet: Annotated[Cat | Dog, Field(discriminator="pet_type")]


def test_the_schemas_pydantic_writes_every_day_are_enforced() -> None:
    assert unenforced(Person.model_json_schema()) is None
    assert unenforced({"type": "integer", "multipleOf": 5}) is None
    assert unenforced({"type": "array", "items": {"type": "string"}, "uniqueItems": False}) is None
    assert unenforced({"$ref": "#/$defs/a", "description": "x", "$defs": {"a": {}}}) is None
    # OpenAPI's number formats are annotations; a oneOf is enforced as an anyOf (vLLM's)
    assert unenforced({"type": "integer", "format": "int32"}) is None
    assert (
        unenforced({"type": ["number", "null"], "format": "double", "enum": [1, 2.5, None]}) is None
    )
    assert unenforced({"oneOf": [{"type": "integer"}, {"type": "string"}], "title": "t"}) is None
    assert unenforced({"type": "string", "pattern": r"^\d+\.\w$"}) is None
    # pydantic's discriminated unions (each branch's const does the discriminator's work),
    # vendor extensions, negated classes (the grammar keeps '"' out), 1.0 as an integer
    assert unenforced(Owner.model_json_schema()) is None
    assert unenforced({"anyOf": [{"type": "integer"}], "x-order": 1}) is None
    assert unenforced({"type": "string", "pattern": '^[^"\\\\]*$'}) is None
    assert unenforced({"type": "string", "pattern": r"^[^\x22]\x41$"}) is None
    # (xgrammar keeps '"', '\\' and control characters out of these classes itself)
    for pattern in (r"^a\sb$", r"^\S+$", r"^[^\n]+$", r"^.+$", r"^x\{2}$"):
        assert unenforced({"type": "string", "pattern": pattern}) is None, pattern
    assert unenforced({"$ref": "#/$defs/a", "example": "x", "$defs": {"a": {}}}) is None
    assert unenforced({"type": "integer", "enum": [1.0, 2]}) is None


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
        ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "'not' (in the schema > properties.a)"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf' of more than one schema"),
        ({"type": "array", "contains": {"const": 1}}, "'contains'"),
        ({"if": {}, "then": {}}, "'if'"),
        ({"type": "string", "pattern": "[a-z]+", "maxLength": 3}, "'pattern' with minLength/maxLength"),
        ({"type": "string", "format": "credit-card"}, "the string format 'credit-card'"),
        ({"type": "number", "multipleOf": 0.5}, "'multipleOf' on a non-integer"),
        ({"$ref": "https://example.com/s.json"}, "the external $ref"),
        ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "minimum": 5}, "'minimum' beside a $ref"),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required ['b']"),
        ({"type": "array", "items": [{"type": "integer"}, {"uniqueItems": True}]}, "items[1]"),
        # (keywords beside a combinator: the grammar enforced the combinator alone)
        ({"type": "object", "properties": {"a": {}}, "oneOf": [{"required": ["a"]}]}, "'properties', 'type' beside 'oneOf'"),
        ({"type": "integer", "minimum": 0, "anyOf": [{"maximum": 3}]}, "'minimum', 'type' beside 'anyOf'"),
        ({"type": "string", "allOf": [{"type": "integer"}]}, "'type' beside 'allOf'"),
        ({"anyOf": []}, "an empty 'anyOf'"),
        ({"type": "object", "required": ["x"]}, "required ['x'] not among the properties"),
        # (values the grammar would write although they break the schema)
        ({"type": "integer", "const": "x"}, "the value 'x', which is not of type 'integer'"),
        ({"type": "string", "enum": ["a", 1, None]}, "the value 1, which is not of type 'string'"),
        ({"type": "boolean", "const": 1}, "the value 1, which is not of type 'boolean'"),
        ({"type": []}, "an empty 'type' list"),
        ({"type": "string", "pattern": '^a"b$'}, "a 'pattern' that matches"),
        ({"type": "string", "pattern": r"^a\\b$"}, "a 'pattern' that matches"),
        ({"type": "string", "pattern": r"^\x22$"}, "a 'pattern' that matches"),
        ({"type": "string", "pattern": r"^\u{22}$"}, "a 'pattern' that matches"),
        ({"type": "string", "pattern": r"^a\nb$"}, "or a control character"),
        ({"type": "string", "pattern": "^[\t\n]{2}$"}, "or a control character"),
        ({"type": "string", "pattern": r"^\cA$"}, "or a control character"),
        ({"type": "string", "pattern": r"^[\u005c]$"}, "a 'pattern' that matches"),
    ],
)  # fmt: skip
def test_what_the_grammar_would_leave_out_is_named(schema: dict[str, Any], named: str) -> None:
    problem = unenforced(schema)
    assert problem is not None and named in problem, problem


def test_the_api_refuses_it_with_a_400_but_serves_a_tools_parameters() -> None:
    schema = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(APIError) as refused:
        one_structure([("response_format", ("json_schema", schema))])
    assert (refused.value.status, refused.value.param) == (400, "response_format")
    assert "cannot enforce 'uniqueItems'" in refused.value.message
    assert one_structure([("tools", ("json_schema", schema))]) == ("json_schema", schema)


def test_the_offline_llm_refuses_it_before_generating(tiny_checkpoint: Any) -> None:
    llm = LLM(model=str(tiny_checkpoint()), num_kv_blocks=16)
    params = SamplingParams(max_tokens=4, json_schema={"type": "number", "multipleOf": 0.5})
    with pytest.raises(InvalidRequestError, match="cannot enforce 'multipleOf'"):
        llm.generate([[1, 2, 3]], params)
    assert not llm.engine.has_unfinished_requests()


def test_a_schema_nested_too_deeply_is_refused_offline_too(tiny_checkpoint: Any) -> None:
    schema: dict[str, Any] = {}
    for _ in range(2000):
        schema = {"type": "object", "properties": {"a": schema}}
    llm = LLM(model=str(tiny_checkpoint()), num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="nested too deeply"):
        llm.generate(["hi"], SamplingParams(json_schema=schema, max_tokens=2))


def test_properties_that_are_not_an_object_are_refused_not_a_crash() -> None:
    """`properties: [1]` raised an AttributeError in the check: a 500 / gRPC INTERNAL."""
    from tandem.engine.guided import check_structure

    for schema in ({"type": "object", "properties": [1]}, {"properties": {"a": {"properties": 5}}}):
        with pytest.raises(InvalidRequestError, match="properties must be an object"):
            check_structure(("json_schema", schema))


def test_bad_words_are_bounded() -> None:
    """40,000 bad words held a prefill worker's loop for 20 s (each is tokenized when the
    request starts and checked at every step)."""
    from tandem.engine.sampling_params import MAX_BAD_WORDS

    assert SamplingParams(bad_words=["a"] * MAX_BAD_WORDS).bad_words is not None
    with pytest.raises(InvalidRequestError, match="bad_words"):
        SamplingParams(bad_words=["a"] * (MAX_BAD_WORDS + 1))
