"""Output processing: a sampled token becomes text (incremental detokenizing), stop checks decide
whether the sequence ends, and a request group becomes the `RequestOutput` its caller sees."""
from __future__ import annotations

import time

from treeserve.engine import structured_outputs
from treeserve.engine.detokenizer import fast_decode, find_stop_string, stop_hold_back
from treeserve.engine.request import Request, RequestGroup
from treeserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.decode = fast_decode(tokenizer)

    def append_token(self, request: Request, token_id: int, logprobs: dict | None) -> tuple[str | None, str | int | None]:
        """Appends a sampled token and makes its text; returns (finish reason, stop reason), (None,
        None) to go on."""
        reason, stop_reason = self.append_token_id(request, token_id, logprobs)
        found = self.make_text(request)
        if found is not None:  # a stop string ends the sequence whatever else would have
            reason, stop_reason = "stop", found
        self.finish_text(request, reason, stop_reason)
        return reason, stop_reason

    def append_token_id(self, request: Request, token_id: int, logprobs: dict | None) -> tuple[str | None, str | int | None]:
        """What needs no text: the token appended, its logprob summed, the grammar advanced, and the
        sequence ended by a stop token, its length limit or a finished grammar. Its text waits in
        `request.pending_text` for `make_text` (a stop string can still end the sequence there)."""
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        request.append_output_token(token_id)
        if logprobs is not None:
            request.cumulative_logprob += logprobs[token_id][0]
        grammar = structured_outputs.advance(request.matcher, token_id) if request.matcher is not None else None
        stopped_by = self._stop_token(request, token_id)
        request.pending_text.append((token_id, logprobs, stopped_by is not None))
        if grammar not in (None, "stop"):  # the grammar engine failed: "error" (vLLM's), what it said as the reason
            return "error", grammar
        if stopped_by is not None:
            return stopped_by
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return "length", None
        return ("stop", None) if grammar == "stop" else (None, None)

    def make_text(self, request: Request) -> str | None:
        """The pending tokens' text (and decoded logprobs); the stop string it completes, if any
        (the text then ends where the stop string says). (This runs for every request at every
        step: names are bound outside the loop, and a request without stop strings checks none.)"""
        found = None
        pending, params, detokenizer = request.pending_text, request.sampling_params, request.detokenizer
        include_stop, stops, min_tokens = params.include_stop_str_in_output, params.stop_strings, params.min_tokens
        position = request.num_output_tokens - len(pending)  # (tokens whose text is made)
        for token_id, logprobs, stop_token in pending:
            position += 1
            if logprobs is not None:
                request.logprobs.append(self.decoded_logprobs(logprobs, params.detokenize))
            delta = ""
            if not stop_token or include_stop:
                # a stop token's own text (an EOS that skip_special_tokens=False keeps) only where asked for, as vLLM
                delta = detokenizer.push(token_id)
                request.output_text = detokenizer.text
            if stops and not stop_token and found is None and position > min_tokens:
                found = self._stop_string(request, len(delta))
        pending.clear()
        return found

    @staticmethod
    def finish_text(request: Request, reason: str | None, stop_reason) -> None:
        """A stop string already cut the text where it must end; otherwise flush held-back bytes."""
        if reason is not None and not isinstance(stop_reason, str):
            request.detokenizer.flush()
            request.output_text = request.detokenizer.text

    def decoded_logprobs(self, logprobs: dict[int, tuple[float, int]], detokenize: bool = True) -> dict[int, Logprob]:
        """Each token's Logprob, its text decoded unless the request said detokenize=False (None, as vLLM's)."""
        decode = self.decode if detokenize else (lambda ids, skip: None)
        return {tid: Logprob(lp, rank, decode([tid], False)) for tid, (lp, rank) in logprobs.items()}

    @staticmethod
    def _stop_token(request: Request, token_id: int) -> tuple[str, int | None] | None:
        """("stop", stop reason) when the token ends the sequence (EOS, a stop token id), else None."""
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            return None
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return "stop", None
        if token_id in params.stop_token_ids:
            return "stop", token_id
        return None

    @staticmethod
    def _stop_string(request: Request, new_chars: int) -> str | None:
        """The stop string the last `new_chars` characters complete (checked only past the first
        min_tokens tokens, as vLLM: those are written whatever they say)."""
        params = request.sampling_params
        found = find_stop_string(request.output_text, new_chars, params.stop_strings)
        if found is None:
            return None
        stop, start = found
        end = start + len(stop) if params.include_stop_str_in_output else start
        request.output_text = request.output_text[:end]
        return stop

    def make_output(self, group: RequestGroup) -> RequestOutput | None:
        """The group's output: every sample whole, or with `group.delta` what each sample added since
        the last (samples that added nothing are left out; None when none did)."""
        children = group.children
        if group.delta:
            if len(children) == 1:  # (the common case, at every step of every streamed request)
                out = _delta(0, children[0])
                if out is None:
                    return None
                outputs = [out]
            else:
                outputs = [out for i, c in enumerate(children) if (out := _delta(i, c)) is not None]
                if not outputs:
                    return None
        else:
            outputs = [
                CompletionOutput(
                    index=i, text=c.output_text, token_ids=list(c.output_token_ids),
                    cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                    logprobs=list(c.logprobs) if c.logprobs is not None else None,
                    finish_reason=_finish_reason(c), stop_reason=c.stop_reason,
                )
                for i, c in enumerate(children)
            ]
        first = children[0]
        prompt_logits = first.prompt_logits if first.prefill_only else {}
        finished = group.finished
        output = RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished,
                               num_cached_tokens=first.num_cached_tokens, prompt_logits=prompt_logits,
                               metrics=request_metrics(group, finished), prompt_logprobs=group.prompt_logprobs,
                               delta=group.delta)
        if first.speculative_config is not None:
            output.num_draft_tokens = sum(c.num_draft_tokens for c in children)
            output.num_accepted_tokens = sum(c.num_accepted_tokens for c in children)
        return output


def _finish_reason(c: Request) -> str | None:
    return c.finish_reason if c.finish_reason != "prefill" else "stop"


def _delta(index: int, c: Request) -> CompletionOutput | None:
    """What the sample added since its last delta output: its new tokens and logprobs, and its new
    text except, while it runs, the characters that could still begin a stop string (a stop string
    cuts the text where it starts: the cut never reaches text already sent). None: nothing new."""
    finished, stops, sent_chars = c.finish_reason is not None, c.sampling_params.stop_strings, c.num_sent_chars
    end = len(c.output_text) - (stop_hold_back(stops) if stops and not finished else 0)
    if end < sent_chars:  # (max(), spelt out: this runs for every streamed request at every step)
        end = sent_chars
    tokens = c.output_token_ids[c.num_sent_tokens:]
    if not tokens and end == sent_chars and (not finished or c.sent_finish):
        return None
    text = c.output_text[sent_chars:end]
    logprobs = None if c.logprobs is None else c.logprobs[c.num_sent_logprobs:]
    c.num_sent_tokens, c.num_sent_chars, c.sent_finish = len(c.output_token_ids), end, finished
    c.num_sent_logprobs += len(logprobs or ())
    return CompletionOutput(index=index, text=text, token_ids=tokens,
                            cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                            logprobs=logprobs, finish_reason=_finish_reason(c), stop_reason=c.stop_reason)


def request_metrics(group: RequestGroup, finished: bool) -> RequestMetrics:
    """`finished`: `group.finished` (which the caller has already read)."""
    children = group.children
    if len(children) == 1:  # (the common case, at every step of every request: no lists)
        scheduled, first_token = children[0].first_scheduled_time, children[0].first_token_time
    else:
        scheduled = min((c.first_scheduled_time for c in children if c.first_scheduled_time is not None), default=None)
        first_token = min((c.first_token_time for c in children if c.first_token_time is not None), default=None)
    metrics = RequestMetrics(arrival_time=group.arrival_time, first_scheduled_time=group.first_scheduled_time or scheduled,
                             first_token_time=first_token)
    if finished:
        metrics.finished_time, metrics.n = time.monotonic(), len(children)
        metrics.max_tokens = None if children[0].prefill_only else children[0].max_tokens
        metrics.longest_sample = max(c.num_output_tokens for c in children)
    return metrics
