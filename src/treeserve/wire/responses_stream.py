"""A streamed chat reply as the Responses API's typed events: `response.created`, `response.in_progress`,
then per output item `response.output_item.added`, its text (`response.content_part.added`,
`response.output_text.delta`, `...done`) or its call's arguments (`response.function_call_arguments.delta`,
`...done`), `response.output_item.done`, and at the end `response.completed` (or `response.incomplete`,
or `response.failed`) with the whole response. Every event carries its `sequence_number`."""
from __future__ import annotations

from treeserve.wire.responses import call_item, finished, item_status, message_item, new_id
from treeserve.wire.translated_stream import ChunkEvents


# the codes of a failed response's `error` that OpenAI's types allow and a served model can meet
FAILURE_CODES = {"server_error", "rate_limit_exceeded", "invalid_prompt"}


class ResponseEvents(ChunkEvents):
    def __init__(self, response: dict):
        self.response = response      # the skeleton (wire/responses.py), then the final response
        self.output: list[dict] = []  # the items closed so far
        self.open: dict | None = None  # the item being written
        self.calls: dict[int, int] = {}  # the chat's tool call index -> position in `output` once opened
        self.sequence = 0

    def start(self, first_chunk: dict | None) -> list[dict]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def finish(self) -> list[dict]:
        status = item_status(self.finish_reason)  # (the last item's: the one max_output_tokens cut)
        events = self._close(status)
        if not self.output:  # no text and no call: an empty message, as a whole reply has
            events += self._open_message() + self._close(status)
        self.response = finished(dict(self.response, output=self.output), self.finish_reason, self.usage)
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self.response)]

    def fail(self, status: int, message: str, code: str | None = None) -> list[dict]:
        """A stream broken off: what was written, and the error (with one of the codes OpenAI's types allow;
        treeserve's own, such as grammar_failed, in its message)."""
        events = self._close()
        if code not in FAILURE_CODES:
            message = f"{message} ({code})" if code else message
            code = "rate_limit_exceeded" if status == 429 else "server_error"
        self.response = dict(self.response, output=self.output, status="failed",
                             error={"code": code, "message": message})
        return events + [self._event("response.failed", response=self.response)]

    # ---- items -------------------------------------------------------------------------------
    def _text(self, text: str) -> list[dict]:
        writing = self.open is not None and self.open["type"] == "message"
        events = [] if writing else self._close() + self._open_message()
        self.open["content"][0]["text"] += text
        return events + [self._event("response.output_text.delta", item_id=self.open["id"],
                                     output_index=len(self.output), content_index=0, delta=text, logprobs=[])]

    def _open_message(self) -> list[dict]:
        self.open = message_item("", status="in_progress")
        added = dict(self.open, content=[])
        return [self._event("response.output_item.added", output_index=len(self.output), item=added),
                self._event("response.content_part.added", item_id=self.open["id"], output_index=len(self.output),
                            content_index=0, part=self.open["content"][0] | {"text": ""})]

    def _call(self, delta: dict) -> list[dict]:
        events = []
        function = delta.get("function") or {}
        if delta.get("id") is not None:  # a call announced: it starts an item
            events += self._close()
            self.open = call_item(delta["id"], function.get("name") or "", "", new_id("fc"), status="in_progress")
            self.calls[delta.get("index", 0)] = len(self.output)
            events.append(self._event("response.output_item.added", output_index=len(self.output),
                                      item=dict(self.open)))
        fragment = function.get("arguments") or ""
        if fragment and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += fragment
            events.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=len(self.output), delta=fragment))
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, events = len(self.output), []
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=[]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part)]
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        self.output.append(item)
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

