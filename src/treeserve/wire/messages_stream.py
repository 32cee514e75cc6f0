"""A streamed chat reply as Anthropic's Messages events: `message_start`, per content block
`content_block_start`, its `text_delta`s or `input_json_delta`s, `content_block_stop`, then
`message_delta` (stop reason, usage) and `message_stop`; a failure mid-stream is an `error` event."""
from __future__ import annotations

from treeserve.wire.errors import anthropic_error
from treeserve.wire.messages import MessagesRequest, skeleton, stop, usage
from treeserve.wire.translated_stream import ChunkEvents


class MessageEvents(ChunkEvents):
    def __init__(self, request: MessagesRequest, model: str):
        self.request, self.message = request, skeleton(model)
        self.block: int | None = None     # the open block's index
        self.block_kind: str | None = None
        self.blocks = 0
        self.called = False  # a tool_use block was opened

    def opens(self, chunk: dict) -> bool:
        """The first chunk with a delta or a finish, or the last (usage alone): a chat stream's first
        chunk, its role's, comes before the prompt is computed, so its usage (continuous usage's)
        does not know how much of the prompt the prefix cache held; the next one's does."""
        choices = chunk.get("choices") or ()
        if not choices:
            return isinstance(chunk.get("usage"), dict)
        return any((c.get("delta") or {}).get("content") or (c.get("delta") or {}).get("tool_calls")
                   or c.get("finish_reason") for c in choices)

    def start(self, first_chunk: dict | None) -> list[dict]:
        """`message_start` with the prompt's usage, as Anthropic's (the chat stream is asked for usage
        in every chunk; a backend that sends none leaves it 0)."""
        message = self.message
        if first_chunk is not None and isinstance(first_chunk.get("usage"), dict):
            message = message | {"usage": usage(first_chunk["usage"]) | {"output_tokens": 0}}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _text(self, text: str) -> list[dict]:
        events = [] if self.block_kind == "text" else self._open({"type": "text", "text": ""})
        return events + [self._delta({"type": "text_delta", "text": text})]

    def _call(self, call: dict) -> list[dict]:
        function, events = call.get("function") or {}, []
        if call.get("id") is not None:
            self.called = True
            events += self._open({"type": "tool_use", "id": call["id"], "name": function.get("name") or "", "input": {}})
        if function.get("arguments") and self.block_kind == "tool_use":
            events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return events

    def finish(self) -> list[dict]:
        reason, sequence = stop(self.finish_reason, self.stop_reason, self.request.stop_sequences, self.called)
        return self._close() + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": usage(self.usage)}, {"type": "message_stop"}]

    def fail(self, status: int, message: str, code: str | None = None) -> list[dict]:
        return [anthropic_error(status, message)]

    def _open(self, block: dict) -> list[dict]:
        events = self._close()
        self.block, self.block_kind = self.blocks, block["type"]
        self.blocks += 1
        return events + [{"type": "content_block_start", "index": self.block, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.block, "delta": delta}

    def _close(self) -> list[dict]:
        if self.block is None:
            return []
        index, self.block, self.block_kind = self.block, None, None
        return [{"type": "content_block_stop", "index": index}]
