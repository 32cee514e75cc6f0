"""Sampled tokens into requests, and request groups into `RequestOutput`s, with the text of a step's
tokens optionally made one step later (async output processing: while the device runs the next
step). A request with stop strings has its text made at once: a stop string must end it before the
next schedule."""
from __future__ import annotations

from treeserve.engine.output_processor import OutputProcessor
from treeserve.engine.request import Request, RequestGroup
from treeserve.engine.request_groups import RequestGroups
from treeserve.outputs import RequestOutput


class DeferredOutputs:
    def __init__(self, processor: OutputProcessor, groups: RequestGroups, async_output: bool):
        self.processor, self.groups, self.async_output = processor, groups, async_output
        self._text: list[Request] = []  # sampled last step, text not made yet
        self._groups: dict[str, RequestGroup] = {}

    @property
    def pending(self) -> bool:
        return bool(self._groups)

    def append_token(self, request: Request, group: RequestGroup, token_id: int,
                     logprobs: dict | None) -> tuple[str | None, str | int | None]:
        """Appends the token (its text now, or deferred); returns (finish reason, stop reason) as
        `OutputProcessor.append_token` does."""
        if self.async_output and not request.sampling_params.stop_strings:
            reason, stop_reason = self.processor.append_token_id(request, token_id, logprobs)
            self._text.append(request)
        else:
            reason, stop_reason = self.processor.append_token(request, token_id, logprobs)
        if self.async_output and request.pending_text:
            self._groups[group.request_id] = group
        return reason, stop_reason

    def outputs_of(self, touched: dict[str, RequestGroup]) -> list[RequestOutput]:
        """Outputs of the groups a step touched, except those whose text is deferred."""
        return self._made(g for g in touched.values() if g.request_id not in self._groups and _wants_output(g))

    def flush(self) -> list[RequestOutput]:
        """The deferred tokens' text, then their groups' outputs (an aborted group's are dropped)."""
        if not self._groups:
            return []
        make_text, finish_text = self.processor.make_text, self.processor.finish_text
        for request in self._text:
            make_text(request)  # no stop strings among these: it ends nothing
            if request.is_finished:
                finish_text(request, request.finish_reason, request.stop_reason)
        self._text.clear()
        groups, self._groups = self._groups, {}
        return self._made(g for g in groups.values() if self.groups.is_live(g) and _wants_output(g))

    def _made(self, groups) -> list[RequestOutput]:
        """The groups' outputs (a delta group with nothing new has none); a finished group is dropped."""
        outputs, make_output, pop = [], self.processor.make_output, self.groups.pop
        for group in groups:  # (every group at every step: `make_output` below, its calls bound once)
            output = make_output(group)
            if output is not None:
                if output.finished:
                    pop(group.request_id)
                outputs.append(output)
        return outputs


def _wants_output(group: RequestGroup) -> bool:
    return group.finished or not group.final_only
