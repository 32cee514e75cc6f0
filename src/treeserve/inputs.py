"""vLLM's prompt dicts (`vllm.inputs`, also `from vllm import TokensPrompt`): besides a string or a list
of token ids, what `LLM.generate` and `LLM.beam_search` take. They are TypedDicts, as vLLM's, so
`TokensPrompt(prompt_token_ids=[...])` is a plain dict; the keys vLLM has for inputs treeserve cannot
use (`multi_modal_data`, `prompt_embeds`, ...) are a ParamError naming them (entrypoints/llm.py)."""
from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str                   # tokenized with the tokenizer's special tokens (a BOS), as vLLM's
    cache_salt: NotRequired[str]  # prefix-cache entries are shared only between prompts of one salt


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]      # shown as the output's `prompt`; the token ids are what runs
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt
