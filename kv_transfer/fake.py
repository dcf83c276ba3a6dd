"""A local transport with fault injection, for protocol unit tests.

`drop`, `duplicate` and `hold` act on the next messages whose header matches a predicate;
`release_held()` delivers held messages (in reverse order, to test reordering).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.kv_transfer.base import Message
from tandem.kv_transfer.local import LocalHub, LocalTransport

Predicate = Callable[[dict[str, Any]], bool]


class FakeTransport(LocalTransport):
    name = "fake"

    def __init__(self, auth_token: str, *, hub: LocalHub) -> None:
        super().__init__(auth_token, hub=hub)
        self.sent: list[dict[str, Any]] = []
        self._rules: list[tuple[str, Predicate]] = []
        self._held: list[tuple[str, Message]] = []

    def drop(self, when: Predicate) -> None:
        self._rules.append(("drop", when))

    def duplicate(self, when: Predicate) -> None:
        self._rules.append(("duplicate", when))

    def hold(self, when: Predicate) -> None:
        self._rules.append(("hold", when))

    def release_held(self) -> None:
        held, self._held = self._held, []
        for peer, message in reversed(held):
            super().deliver(peer, message)

    def deliver(self, peer: str, message: Message) -> None:
        self.sent.append(message.header)
        for i, (action, when) in enumerate(self._rules):
            if when(message.header):
                del self._rules[i]
                if action == "drop":
                    return
                if action == "hold":
                    self._held.append((peer, message))
                    return
                super().deliver(peer, message)
                break
        super().deliver(peer, message)
