"""Request intake: an API request checked against the model and turned into the engine's `Request`s
(its `n` samples, the prefill they share, or one prefill-only request) and queued."""
from __future__ import annotations

from treeserve.engine.detokenizer import NO_TEXT, IncrementalDetokenizer
from treeserve.engine.kept_kv import KeptSequences
from treeserve.engine.kv_cache_manager import KVCacheManager
from treeserve.engine.loaded_model import LoadedModel
from treeserve.engine.request import Request, RequestGroup
from treeserve.engine.request_groups import RequestGroups
from treeserve.engine.scheduler import Scheduler
from treeserve.engine.structured_outputs import StructuredOutputs
from treeserve.engine.token_masks import bad_word_sequences, check_something_is_left
from treeserve.errors import ParamError, check_context_length
from treeserve.sampling_params import RequestOutputKind, SamplingParams


class RequestIntake:
    def __init__(self, loaded: LoadedModel, scheduler: Scheduler, kv: KVCacheManager, groups: RequestGroups,
                 retained: KeptSequences, structured: StructuredOutputs, decode):
        self.loaded, self.scheduler, self.kv, self.groups = loaded, scheduler, kv, groups
        self.retained, self.structured, self.decode = retained, structured, decode
        self.rotary = loaded.model.rotary

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        _require_token_list(prompt_token_ids)
        if not prompt_token_ids:
            raise ParamError("prompt", "must not be empty")
        check_context_length(self.loaded.max_model_len, len(prompt_token_ids))
        vocab = self.loaded.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError("prompt", f"token id {bad!r} is outside the vocabulary [0, {vocab})")

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None,
            cache_salt: str | None, logits_positions: list[int] | None, readout_token_ids: list[int] | None,
            keep_kv: bool, parent_id: str | None, priority: int, final_only: bool,
            draft_group: str | None = None, speculative_config=None) -> None:
        """See `LLMEngine.add_request`."""
        prompt_token_ids = self.truncated_prompt(prompt_token_ids, params)
        self.validate_prompt(prompt_token_ids)
        if request_id in self.groups or request_id in self.retained:
            raise ParamError("request_id", f"{request_id!r} is already in use")
        self._check_params(params, prefill_only=logits_positions is not None)
        params = self._with_bad_words_tokens(self._with_logprob_counts(params))
        if logits_positions is not None:
            self._add_prefill_only(request_id, prompt_token_ids, params, prompt, cache_salt, logits_positions,
                                   readout_token_ids, keep_kv, parent_id, priority)
            return
        children = [self._make_request(f"{request_id}#{i}", prompt_token_ids, _child_params(params, i), cache_salt,
                                       priority) for i in range(params.n)]
        for child in children:
            child.draft_group, child.speculative_config = draft_group or request_id, speculative_config
        kind = params.output_kind
        group = RequestGroup(request_id, prompt, list(prompt_token_ids), children,
                             final_only=final_only or kind is RequestOutputKind.FINAL_ONLY,
                             delta=kind is RequestOutputKind.DELTA)
        self.groups.add(group)
        # (LongRoPE picks its factors by prompt length: the shorter shared prefill could pick others)
        if params.n > 1 and len(prompt_token_ids) > 1 and not self.rotary.long_offset:
            shared = Request(f"{request_id}#prefill", list(prompt_token_ids[:-1]), params, cache_salt=cache_salt,
                             cache_namespace=self.loaded.name, prefill_only=True, priority=priority)
            group.shared_prefill = shared
            self.groups.add_member(shared.request_id, group)
            _want_prompt_logprobs(group, shared)
            self.scheduler.add(shared)
        else:
            _want_prompt_logprobs(group, children[0])
            for child in children:
                self.scheduler.add(child)

    def truncated_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (vLLM's left truncation; -1: max_model_len),
        or the prompt as it is."""
        _require_token_list(prompt_token_ids)  # (before the cut: a text's last characters are a list)
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prompt_token_ids
        limit = self.loaded.max_model_len
        if keep == -1:
            keep = limit
        if keep > limit:
            raise ParamError("truncate_prompt_tokens", f"{keep} is greater than the model's max_model_len ({limit}): "
                             "select a smaller truncation size (or -1 for max_model_len)")
        return list(prompt_token_ids[-keep:])

    def check_token_ids(self, params: SamplingParams) -> None:
        """The token ids the parameters name (logit_bias, allowed_token_ids, bad_words' tokens) are in
        this model's vocabulary, and allowed_token_ids leave something to sample."""
        vocab = self.loaded.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ParamError("logit_bias", f"token id {max(params.logit_bias)} is outside the vocabulary [0, {vocab})")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            outside = sorted(t for t in set(params.allowed_token_ids) if t >= vocab)
            raise ParamError("allowed_token_ids", f"token ids {outside[:8]} are outside the vocabulary [0, {vocab})")
        sequences = bad_word_sequences(self.loaded.tokenizer, params.bad_words, vocab) if params.bad_words else ()
        check_something_is_left(params, sequences, self.loaded.eos_token_ids)

    def _with_logprob_counts(self, params: SamplingParams) -> SamplingParams:
        """`params` with vLLM's -1 (`logprobs`, `prompt_logprobs`: the whole vocabulary) made this model's
        vocabulary size (a copy: the caller's may serve another model)."""
        vocab = self.loaded.model_config.vocab_size
        whole = {name: vocab for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1}
        return params.clone(**whole) if whole else params

    def _with_bad_words_tokens(self, params: SamplingParams) -> SamplingParams:
        """`params` with its bad words as this model's token sequences (a copy: the caller's may serve
        another model, whose tokenizer writes them otherwise)."""
        if not params.bad_words:
            return params
        sequences = bad_word_sequences(self.loaded.tokenizer, params.bad_words, self.loaded.model_config.vocab_size)
        params = params.clone()
        params.bad_words_token_ids = sequences
        return params

    def _cache_namespace(self, num_prompt_tokens: int) -> str:
        """Prefix-cache hashes are per model, and with LongRoPE per regime: a prompt past the original
        length computes every position with the long factors, so its blocks never stand in for a
        shorter prompt's (or the other way round)."""
        name = self.loaded.name
        rotary = self.rotary
        return f"{name}:longrope" if rotary.long_offset and num_prompt_tokens > rotary.long_from else name

    def _check_params(self, params: SamplingParams, prefill_only: bool) -> None:
        """What the parameters ask of this model, checked before anything is queued; a grammar that
        cannot compile fails here (compiled once, then cached)."""
        model_config = self.loaded.model_config
        if not prefill_only and model_config.head != "lm":
            raise ParamError("model", f"{self.loaded.model_dir.name} is a process reward model "
                             f"({model_config.architecture}): it scores steps (/v1/rewards, a search's "
                             "verifier) and generates nothing")
        self.check_token_ids(params)
        _check_logprob_counts(params, model_config.vocab_size, self.loaded.config.max_logprobs)
        if prefill_only and params.structured_outputs is not None:
            raise ParamError("structured_outputs", "not available with logits_positions (nothing is sampled)")
        if prefill_only and params.prompt_logprobs is not None:
            raise ParamError("prompt_logprobs", "not available with logits_positions (they return the logits)")
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)

    def _add_prefill_only(self, request_id, prompt_token_ids, params, prompt, cache_salt, positions,
                          readout_token_ids, keep_kv, parent_id, priority) -> None:
        bad = [p for p in positions if not isinstance(p, int) or not 0 <= p < len(prompt_token_ids)]
        if bad:
            raise ParamError("logits_positions", f"{bad[:3]} outside the prompt (length {len(prompt_token_ids)})")
        width = self.loaded.model_config.output_width  # the vocabulary, or a reward head's outputs
        if readout_token_ids is not None and not all(0 <= t < width for t in readout_token_ids):
            raise ParamError("readout_token_ids", f"ids must be in [0, {width})")
        namespace = self._cache_namespace(len(prompt_token_ids))
        parent = self.retained.parent(parent_id, prompt_token_ids)
        if parent is not None and parent.cache_namespace != namespace:
            parent = None  # LongRoPE: the kept keys were rotated with the other factors; computed afresh
        request = Request(f"{request_id}#0", list(prompt_token_ids), params, cache_salt=cache_salt,
                          cache_namespace=namespace, prefill_only=True, logits_positions=sorted(set(positions)),
                          readout_token_ids=readout_token_ids, keep_kv=keep_kv, priority=priority)
        self.groups.add(RequestGroup(request_id, prompt, list(prompt_token_ids), [request]))
        if parent is not None:
            self.kv.fork(parent, request)
            request.num_cached_tokens = request.num_computed_tokens
        self.scheduler.add(request)

    def _make_request(self, request_id, prompt_token_ids, params, cache_salt, priority=0) -> Request:
        room = self.loaded.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.loaded.eos_token_ids,
                          max_tokens=max_tokens, cache_salt=cache_salt,
                          cache_namespace=self._cache_namespace(len(prompt_token_ids)), priority=priority)
        request.detokenizer = IncrementalDetokenizer(self.loaded.tokenizer, prompt_token_ids,
                                                     params.skip_special_tokens, self.decode) \
            if params.detokenize else NO_TEXT
        if params.structured_outputs is not None:
            request.matcher = self.structured.matcher(params.structured_outputs)
        return request


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return params.clone(n=1, seed=seed)


def _check_logprob_counts(params: SamplingParams, vocab: int, cap: int | None) -> None:
    """`logprobs` and `prompt_logprobs` (-1: the whole vocabulary) within the vocabulary (a top-k past
    it failed the engine's step) and within the engine's `max_logprobs` (vLLM's cap; None or -1: none)."""
    for name in ("logprobs", "prompt_logprobs"):
        wanted = getattr(params, name)
        count = vocab if wanted == -1 else (wanted or 0)
        if count > vocab:
            raise ParamError(name, f"at most the vocabulary's {vocab} tokens, got {wanted}")
        if cap not in (None, -1) and count > cap:
            raise ParamError(name, f"{wanted} is more than the engine's max_logprobs ({cap}); make the engine "
                                   f"with a larger max_logprobs (-1: the whole vocabulary), as vLLM's")


def _require_token_list(prompt_token_ids) -> None:
    """The engine takes token ids (a string's characters, or a dict's keys, were read as token ids)."""
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise ParamError("prompt_token_ids", f"expected a list of token ids, got {type(prompt_token_ids).__name__}: "
                         "the engine takes token ids where vLLM's LLMEngine.add_request takes a prompt; encode "
                         "text with engine.tokenizer.encode(...), or use LLM.generate, which takes text and dicts")


def _want_prompt_logprobs(group: RequestGroup, computing: Request) -> None:
    """The request that computes the group's prompt also computes its prompt logprobs, if asked."""
    if computing.sampling_params.prompt_logprobs is None:
        return
    computing.prompt_logprob_ids = list(group.prompt_token_ids)
    computing.prompt_logprobs = group.prompt_logprobs = [None] * len(group.prompt_token_ids)
