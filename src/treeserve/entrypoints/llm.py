"""Offline API shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Sequence

from tqdm import tqdm

from treeserve.errors import ParamError
from treeserve.config import EngineConfig
from treeserve.engine.engine_loop import EngineLoop
from treeserve.engine.llm_engine import LLMEngine
from treeserve.entrypoints.beam_search import BeamSearch, BeamSearchOutput
from treeserve.entrypoints.chat_utils import render_chat, template_messages
from treeserve.entrypoints.engine_args import config_fields
from treeserve.inputs import PromptType
from treeserve.outputs import RequestOutput
from treeserve.sampling_params import BeamSearchParams, SamplingParams

ProgressBar = bool | Callable[..., tqdm]  # vLLM's use_tqdm: on/off, or what makes the bar (a tqdm-like class, a partial)
POOLING_CALLS = frozenset({"embed", "encode", "classify", "reward", "score"})  # vLLM's, for pooling models
# the keys of vLLM's TextPrompt / TokensPrompt / EmbedsPrompt that change what is generated and that
# treeserve has no use for (multimodal inputs, embeddings instead of tokens, encoder-decoder prompts)
UNSUPPORTED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds",
                           "token_type_ids", "encoder_prompt", "decoder_prompt")


class LLM:
    def __init__(self, model: str, **engine_options: Any):
        """`engine_options`: EngineConfig's fields, and vLLM's arguments whose meaning is what treeserve
        does anyway (engine_args.py; `trust_remote_code` among them: no model code is ever loaded from a
        checkpoint, every architecture is built in)."""
        self.engine = LLMEngine.from_config(EngineConfig(model=model, **config_fields(engine_options)))
        self.loop = EngineLoop(self.engine)
        self._ids = itertools.count()
        # Dropped, the engine stops its tensor-parallel workers, as vLLM's does: tied to the engine, not to
        # this LLM, which a caller may drop while holding `llm.llm_engine` (it was closed under them).
        weakref.finalize(self.engine, self.engine.loaded.close)

    @classmethod
    def from_engine(cls, engine: LLMEngine, loop: EngineLoop | None = None) -> "LLM":
        """An `LLM` over an engine that another owner built; `loop` is the engine loop that steps
        it (a `Runtime`'s), so that one loop owns every engine."""
        llm = cls.__new__(cls)
        llm.engine, llm.loop, llm._ids = engine, loop or EngineLoop.of(engine), itertools.count()
        return llm

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine (`llm.llm_engine.get_tokenizer()` ...): the same object as `engine`."""
        return self.engine

    def close(self) -> None:
        """Frees the engine's weights, KV cache and CUDA graphs now and stops its tensor-parallel
        workers, if it has any (`LLMEngine.close`); afterwards `generate`, `chat` and `beam_search` raise
        EngineClosedError, and `llm_engine.stats()` stays readable. Without it, all of that goes when
        the engine is collected (once neither this LLM nor a caller holding `llm_engine` refers to it)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name: str):
        """vLLM's pooling calls (`embed`, `encode`, `classify`, `reward`, `score`) are named with
        what treeserve offers instead; every other missing attribute is Python's AttributeError."""
        if name in POOLING_CALLS:
            raise AttributeError(f"LLM.{name} is not available: treeserve runs generative models only (no "
                                 f"embedding or pooling runner). A process reward model's step scores come "
                                 f"from Runtime.score_steps (or a server's POST /v1/rewards, /v1/score, /pooling); "
                                 f"token logprobs from SamplingParams(logprobs=..., prompt_logprobs=...)",
                                 name=name, obj=self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forgets every cached prefix (a benchmark's runs start equal); False, and nothing
        changed, while a request still holds blocks."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.engine.generation_defaults.sampling)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: ProgressBar = True, lora_request: None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """`priority` (vLLM's): one per prompt, a lower one admitted first. `lora_request`: None only."""
        _no_lora(lora_request)
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        priorities = _priority_per_prompt(priority, len(prompt_list))
        encoded = [(text, self.engine.truncated_prompt(ids, params), salt)  # (truncate_prompt_tokens)
                   for (text, ids, salt), params in zip(map(self._encode, prompt_list), params_list)]
        for (_, token_ids, _), params in zip(encoded, params_list):  # validate everything before scheduling
            self.engine.validate_prompt(token_ids)
        return self._run([(text, ids, salt, params, rank) for (text, ids, salt), params, rank
                          in zip(encoded, params_list, priorities)], use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: None = None, use_tqdm: ProgressBar = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search: one `BeamSearchOutput` per prompt, its `sequences` best first
        (entrypoints/beam_search.py says how, and where vLLM's and HF's differ). `concurrency_limit`:
        how many prompts are searched at once (all by default); `use_tqdm`: a bar over the steps."""
        _no_lora(lora_request)
        if not isinstance(params, BeamSearchParams):
            raise ParamError("params", f"expected BeamSearchParams, got {type(params).__name__} "
                                       "(e.g. BeamSearchParams(beam_width=4, max_tokens=32))")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ParamError("concurrency_limit", f"must be an integer >= 1 or None, got {concurrency_limit!r}")
        encoded = [self._encode(p) for p in _as_prompt_list(prompts)]
        for _, token_ids, _ in encoded:
            self.engine.validate_prompt(token_ids)
        batch = concurrency_limit or len(encoded)
        outputs: list[BeamSearchOutput] = []
        for start in range(0, len(encoded), batch):
            chunk = [(ids, salt) for _, ids, salt in encoded[start:start + batch]]
            bar = _progress_bar(use_tqdm, params.max_tokens, "Beam search")
            try:
                outputs += BeamSearch(self.engine, self.loop, params).run(chunk, on_step=lambda: bar.update(1))
            finally:
                bar.close()
        return outputs

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: ProgressBar = True, lora_request: None = None, add_generation_prompt: bool = True,
             chat_template: str | None = None, tools: list[dict] | None = None,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Each conversation through the chat template (with `tools`, OpenAI's tool definitions,
        where given; `continue_final_message`: the last assistant message continued, a prefill;
        `chat_template_kwargs`: more variables for the template, `enable_thinking` say), then
        generated; each output's `prompt` is the rendered text, as vLLM's."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ParamError("messages", f"expected a conversation (a list of message dicts) or a non-empty list of "
                                         f"them, got {messages!r:.80}")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        texts = [self._render(c, add_generation_prompt, chat_template, tools, continue_final_message,
                              chat_template_kwargs) for c in conversations]
        prompts = [{"prompt": text, "prompt_token_ids": self.engine.tokenizer.encode(text, add_special_tokens=False)}
                   for text in texts]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[int]:
        text = self._render(conversation, add_generation_prompt, chat_template, tools, continue_final_message,
                            chat_template_kwargs)
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def _render(self, conversation, add_generation_prompt, chat_template, tools, continue_final_message,
                chat_template_kwargs) -> str:
        if tools is not None and (not isinstance(tools, (list, tuple))
                                  or not all(isinstance(t, dict) or callable(t) for t in tools)):
            raise ParamError("tools", f"expected a list of OpenAI's tool definitions ({{'type': 'function', "
                                      f"'function': {{'name': ..., 'parameters': {{...}}}}}}), got {tools!r:.80}")
        if continue_final_message and add_generation_prompt:
            raise ParamError("continue_final_message", "cannot be true with add_generation_prompt (as vLLM): "
                                                       "set add_generation_prompt=False")
        return render_chat(self.engine.tokenizer, template_messages(conversation), tools, add_generation_prompt,
                           chat_template, continue_final_message=continue_final_message,
                           template_kwargs=chat_template_kwargs)

    def _params_per_prompt(self, sampling_params, count: int) -> list[SamplingParams]:
        """One SamplingParams per prompt, each checked again and its derived fields made again (the
        caller may have changed it since it was made, as vLLM's examples do: `sp.stop = [...]`)."""
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params.clone()] * count
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else None
        if params is None or not all(isinstance(p, SamplingParams) for p in params):
            raise ParamError("sampling_params", f"expected SamplingParams, or a list of them, got "
                                                f"{type(sampling_params).__name__} (e.g. SamplingParams(temperature=0))")
        if len(params) != count:
            raise ParamError("sampling_params", f"got {len(params)} for {count} prompts; pass one, or one per prompt")
        checked = {id(p): p.clone() for p in params}  # (once each: a list may repeat one object)
        return [checked[id(p)] for p in params]

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt), None
        if isinstance(prompt, dict):
            unsupported = [key for key in UNSUPPORTED_PROMPT_KEYS if _given(prompt.get(key))]
            if unsupported:  # (vLLM would use them: an answer without them would be silently another one)
                raise ParamError(f"prompt.{unsupported[0]}", "is not supported: treeserve serves text models from "
                                 "'prompt' or 'prompt_token_ids' (and 'cache_salt')")
            salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), salt
            if "prompt" in prompt:
                return prompt["prompt"], self.engine.tokenizer.encode(prompt["prompt"]), salt
            raise ParamError("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt), None
        raise ParamError("prompt", f"expected a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _run(self, items, use_tqdm: ProgressBar) -> list[RequestOutput]:
        ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(use_tqdm, len(items))

        def on_output(output: RequestOutput) -> None:
            if output.finished:
                finished[output.request_id] = output
                bar.update(1)
        try:
            for text, token_ids, salt, params, priority in items:
                request_id = str(next(self._ids))
                self.loop.add_request(self.engine, request_id, token_ids, params, on_output, prompt=text,
                                      cache_salt=salt, priority=priority, final_only=True)
                ids.append(request_id)
            self.loop.run_until(lambda: len(finished) == len(ids))
        except BaseException:
            for request_id in ids:
                self.loop.abort_request(self.engine, request_id)
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def _no_lora(lora_request) -> None:
    if lora_request is not None:
        raise ParamError("lora_request", "LoRA adapters are not supported: leave lora_request out (or None)")


def _priority_per_prompt(priority, count: int) -> list[int]:
    if priority is None:
        return [0] * count
    if not isinstance(priority, (list, tuple)) or not all(isinstance(p, int) and not isinstance(p, bool)
                                                          for p in priority):
        raise ParamError("priority", f"expected a list of integers, one per prompt, got {priority!r:.80}")
    if len(priority) != count:
        raise ParamError("priority", f"got {len(priority)} for {count} prompts; give one per prompt")
    return list(priority)


def _progress_bar(use_tqdm: ProgressBar, total: int, desc: str = "Processed prompts"):
    """The bar counting finished prompts (or steps): tqdm's (shown for two or more) where `use_tqdm`
    is a bool, else the one the callable makes, as vLLM's LLM.generate calls it."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc, dynamic_ncols=True)
    return tqdm(total=total, desc=desc, disable=not use_tqdm or total < 2)


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ParamError("prompts", "expected a prompt or a non-empty list of prompts")
    return list(prompts)


def _given(value) -> bool:
    """Whether a prompt's field says something (None and an empty dict or list say nothing)."""
    return value is not None and not (isinstance(value, (dict, list, tuple)) and len(value) == 0)
