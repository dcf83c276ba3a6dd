"""Responses kept in the router's memory: OpenAI's `store` (true unless a request says false).

`GET /v1/responses/{id}` returns a stored response and `DELETE` forgets it. A request's
`previous_response_id` continues that response's conversation: its input items and its output
items go before the new input, as OpenAI's do (its `instructions` do not carry over).

Each router replica keeps its own responses, the newest `capacity` of them (the oldest are
forgotten first; 0 stores none). With several router replicas a follow-up may reach a replica
that does not hold the response, which is a 404, as for one that was forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tandem.router.errors import APIError


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]  # the conversation before it, as input items

    def conversation(self) -> list[dict[str, Any]]:
        """The input items of a request that goes on from this response."""
        return [*self.input_items, *self.response["output"]]


class ResponsesStore:
    def __init__(self, capacity: int = 1000) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        if self.capacity <= 0:
            return
        self._items[response["id"]] = StoredResponse(response, input_items)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response, or a 404 naming `param` (the field that asked for it)."""
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(
                404,
                f"no response {response_id!r} is stored here (store=false, forgotten, or kept "
                "by another router replica)",
                type="not_found_error",
                param=param,
                code="response_not_found",
            )
        return stored

    def input_items(
        self, response_id: str, *, after: str | None = None, limit: int = 20, order: str = "desc"
    ) -> dict[str, Any]:
        """OpenAI's list of the input items a stored response answered (the conversation
        before it): `limit` of them from after the item `after`, newest first unless `order`
        is "asc". An item given without an id is listed with one of its place."""
        stored = self.get(response_id)
        items = [
            _listed(item, f"{response_id}_input_{i}") for i, item in enumerate(stored.input_items)
        ]
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(404, f"no input item {after!r} in {response_id!r}",
                               type="not_found_error", param="after")  # fmt: skip
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    def delete(self, response_id: str) -> dict[str, Any]:
        """OpenAI's deletion object (404 when there is no such response)."""
        self.get(response_id)
        del self._items[response_id]
        return {"id": response_id, "object": "response", "deleted": True}

    def __len__(self) -> int:
        return len(self._items)


def _listed(item: dict[str, Any], item_id: str) -> dict[str, Any]:
    """An input item as OpenAI lists it: with an id (`item_id` where it came without one),
    and a message's text as a part (`input_text`; an assistant's `output_text`)."""
    listed = {"id": item_id, **item}
    if item.get("type", "message") == "message" and isinstance(item.get("content"), str):
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        part: dict[str, Any] = {"type": kind, "text": item["content"]}
        if kind == "output_text":
            part["annotations"] = []
        listed.update(type="message", content=[part], status=item.get("status", "completed"))
    return listed
