"""The JSON of a completion's choices: chat and legacy logprobs, vLLM's prompt_logprobs, and the
bookkeeping of a streamed reply over the engine's delta outputs (which chunk carries which tokens)."""
from __future__ import annotations

from treeserve.outputs import CompletionOutput, RequestOutput
from treeserve.sampling_params import SamplingParams
from treeserve.wire.completions import CompletionRequest


class DeltaTracker:
    """A streamed reply's bookkeeping over delta outputs: the tokens generated (usage), which choices
    a chunk was sent for, and per choice the token ids and (token id, logprob entry) pairs no chunk
    carried yet (an output with no new text sends no chunk: its tokens go with the next)."""

    def __init__(self):
        self.num_generated = 0
        self._pending: dict = {}
        self._pending_ids: dict = {}
        self._sent: set = set()

    def add(self, key, c: CompletionOutput) -> list | None:
        """Takes a delta; returns the choice's unsent pairs (None without logprobs)."""
        self.num_generated += len(c.token_ids)
        self._pending_ids.setdefault(key, []).extend(c.token_ids)
        if c.logprobs is None:
            return None
        pending = self._pending.setdefault(key, [])
        pending.extend(zip(c.token_ids, c.logprobs))
        return pending

    def token_ids(self, key) -> list[int]:
        """The choice's generated token ids no chunk carried yet (vLLM's `token_ids` of the next chunk)."""
        return list(self._pending_ids.get(key, ()))

    def sent(self, key) -> None:
        self._pending.pop(key, None)
        self._pending_ids.pop(key, None)
        self._sent.add(key)

    def was_sent(self, key) -> bool:
        return key in self._sent


def token_pairs(c: CompletionOutput) -> list | None:
    """A whole completion's (token id, logprob entry) pairs; None without logprobs."""
    return None if c.logprobs is None else list(zip(c.token_ids, c.logprobs))


class CompletionReply:
    """One /v1/completions request's choices: the echoed prompt (with its logprobs, OpenAI's legacy
    format) before the completion, which `max_tokens: 0` leaves out (the engine generated one token)."""

    def __init__(self, request: CompletionRequest, params: SamplingParams, echo: list[str], tokenizer):
        self.params, self.echo, self.tokenizer = params, echo, tokenizer
        self.echo_only = request.echo_only
        self.echo_logprobs = request.echo and params.logprobs is not None
        self.extra_prompt_logprobs = request.prompt_logprobs is not None
        self.return_token_ids = request.return_token_ids
        self.text_sent: dict[int, int] = {}  # streamed: per choice, the characters its chunks carried so far

    def choice(self, prompt_index: int, output: RequestOutput, c: CompletionOutput) -> dict:
        text = self.echo[prompt_index] + ("" if self.echo_only else c.text)
        body = {"index": prompt_index * self.params.n + c.index, "text": text,
                "logprobs": self._logprobs(output, token_pairs(c), True), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}
        body = self._with_token_ids(body, output, list(c.token_ids), True)
        return self._with_prompt_logprobs(body, output)

    def chunk_choice(self, prompt_index: int, output: RequestOutput, c: CompletionOutput, first: bool,
                     pairs: list | None, finished: bool, token_ids: list[int] = ()) -> dict:
        """A chunk's choice for the delta `c` (its text; `pairs`: the tokens' logprobs not sent yet;
        `token_ids`: the tokens no chunk carried yet)."""
        text = (self.echo[prompt_index] if first else "") + ("" if self.echo_only else c.text)
        index = prompt_index * self.params.n + c.index
        offset = self.text_sent.get(index, 0)  # (text_offset counts on across chunks, as vLLM's)
        self.text_sent[index] = offset + len(text)
        body = {"index": index, "text": text,
                "logprobs": self._logprobs(output, pairs, first, offset),
                "finish_reason": c.finish_reason if finished else None,
                "stop_reason": c.stop_reason if finished else None}
        body = self._with_token_ids(body, output, list(token_ids), first)
        return self._with_prompt_logprobs(body, output) if first else body

    def usage(self, usage: dict) -> dict:
        if self.echo_only:  # the generated token is not part of the reply
            usage = usage | {"completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
        return usage

    def _logprobs(self, output: RequestOutput, token_pairs: list | None, with_prompt: bool, offset: int = 0):
        top = self.params.logprobs
        if top is None or token_pairs is None:
            return None
        pairs = []
        if with_prompt and self.echo_logprobs:
            pairs += list(zip(output.prompt_token_ids, output.prompt_logprobs))
        if not self.echo_only:
            pairs += token_pairs
        return legacy_logprobs(pairs, top, self.tokenizer, offset)

    def _with_token_ids(self, body: dict, output: RequestOutput, token_ids: list[int], with_prompt: bool) -> dict:
        """vLLM's `return_token_ids`: the choice's generated ids (none with `max_tokens: 0`, whose one token
        is not part of the reply), and the prompt's (streamed: in the choice's first chunk only)."""
        if not self.return_token_ids:
            return body
        body = body | {"prompt_token_ids": list(output.prompt_token_ids) if with_prompt else None}
        return body | {"token_ids": [] if self.echo_only else token_ids}

    def _with_prompt_logprobs(self, body: dict, output: RequestOutput) -> dict:
        if self.extra_prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs_json(output)
        return body


def prompt_logprobs_json(output: RequestOutput) -> list[dict | None]:
    """vLLM's `prompt_logprobs` in a response: per prompt token, token id -> logprob, rank, text."""
    return [None if entry is None else {
        str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for tid, lp in entry.items()} for entry in output.prompt_logprobs]


def legacy_logprobs(pairs, top: int, tokenizer, offset: int = 0) -> dict:
    """OpenAI's legacy completions `logprobs` for (token id, entry) pairs; a prompt's first token
    has no entry (null logprob and top_logprobs). Each token's `top_logprobs` are the `top` most likely
    and the token's own (OpenAI's "up to logprobs+1 elements", as vLLM's: `logprobs: 0` gives the
    token's alone, not null)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in pairs:
        chosen = entry[token_id] if entry is not None else None
        token = chosen.decoded_token if chosen is not None else tokenizer.decode([token_id])
        tokens.append(token)
        token_logprobs.append(chosen.logprob if chosen is not None else None)
        top_logprobs.append(_top_and_chosen(entry, chosen, top))
        offsets.append(offset)
        offset += len(token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _top_and_chosen(entry: dict | None, chosen, top: int) -> dict | None:
    """A legacy `top_logprobs` entry: the `top` best ranked and the chosen token, best first."""
    if not entry:
        return None
    ranked = sorted((lp for lp in entry.values() if lp.rank <= top), key=lambda lp: lp.rank)[:top]
    if chosen is not None and all(lp is not chosen for lp in ranked):
        ranked.append(chosen)
    return {lp.decoded_token: lp.logprob for lp in ranked}


def token_info(token_id: int, lp, token_bytes) -> dict:
    """A chat logprob's token: its text, and its own bytes (a token that is part of a multi-byte
    character decodes alone to U+FFFD; its bytes joined with its neighbours' make the character)."""
    return {"token": lp.decoded_token or "", "logprob": lp.logprob, "bytes": list(token_bytes(token_id))}


def chat_logprobs(pairs: list | None, top: int | None, token_bytes):
    """OpenAI's chat `logprobs` for (token id, logprob entry) pairs (None: none were asked for);
    `token_bytes`: token id -> its bytes (engine/token_bytes.py)."""
    if top is None or pairs is None:
        return None
    content = []
    for token_id, entry in pairs:
        ranked = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank <= top), key=lambda item: item[1].rank)
        content.append({**token_info(token_id, entry[token_id], token_bytes),
                        "top_logprobs": [token_info(tid, lp, token_bytes) for tid, lp in ranked[:top]]})
    return {"content": content}
