"""The responses store (vLLM's response_store + msg_store, bounded): response id -> the stored response and the
conversation it answered, so that GET /v1/responses/{id} finds it and `previous_response_id` continues it.

In memory, per server instance, at most max_entries responses; storing one more evicts the least recently used
(stored or continued) first. An entry keeps the response as it was sent and the input items of its conversation
(every earlier turn and this request's input; never `instructions`, which OpenAI does not carry over); a
continuation's history is those items followed by the response's output items. Entries of one conversation share
their item objects, so a long chain costs a list of references per turn, not a copy of the conversation."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_MAX_ENTRIES = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as the client got it (status completed, incomplete or failed)
    conversation: tuple  # the input items it answered (protocol_responses' item models), oldest first


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES):
        assert max_entries >= 0, max_entries
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def put(self, response: dict, conversation) -> None:
        self._entries[response["id"]] = StoredResponse(response, tuple(conversation))
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def pop(self, response_id: str) -> StoredResponse | None:
        return self._entries.pop(response_id, None)

    def __len__(self) -> int:
        return len(self._entries)
