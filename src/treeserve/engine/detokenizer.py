"""Incremental detokenization and stop-string handling.

Text is produced by decoding a short window of recent tokens and emitting only what extends the
previous window, and never while the window ends inside an incomplete UTF-8 sequence ("\\ufffd").
The window starts a few prompt tokens back so that tokenizers which drop a leading space on
the first token (SentencePiece's Metaspace) still render the first output token correctly.
"""
from __future__ import annotations

from typing import Callable

PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def fast_decode(tokenizer) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)`: the Rust tokenizer's own decode where the transformers
    wrapper would only forward to it (a fast tokenizer with no `_decode` of its own and no
    clean-up of spaces), which skips the wrapper's per-call conversions (~5x less host time per
    token); the wrapper otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
        plain = type(tokenizer)._decode is TokenizersBackend._decode
    except (ImportError, AttributeError):
        plain = False
    if backend is not None and plain and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode  # decode(ids, skip_special_tokens)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 decode: Callable[[list[int], bool], str] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = decode or fast_decode(tokenizer)
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text it completes (possibly empty). (Called for every token
        of every request: the decode is called directly, names bound once.)"""
        tokens, decode, skip, start = self.tokens, self._decode_ids, self.skip_special_tokens, self.prefix_offset
        tokens.append(token_id)
        prefix_text = decode(tokens[start:self.read_offset], skip)
        full_text = decode(tokens[start:], skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a sequence, emits whatever is still held back (even a lone "\\ufffd")."""
        if self.read_offset == len(self.tokens):
            return ""
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset:])
        delta = full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""
        self.read_offset = len(self.tokens)
        self.text += delta
        return delta


class _NoText:
    """The detokenizer of a request with detokenize=False (vLLM's): its outputs carry token ids, no text."""
    text = ""

    @staticmethod
    def push(token_id: int) -> str:
        return ""

    @staticmethod
    def flush() -> str:
        return ""


NO_TEXT = _NoText()


def find_stop_string(text: str, new_chars: int, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """Earliest stop string that ends within the last `new_chars` characters: (stop, start index)."""
    best = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start != -1 and (best is None or start < best[1]):
            best = (stop, start)
    return best


def stop_hold_back(stops: tuple[str, ...]) -> int:
    """Characters a stream must hold back so that a stop string is never emitted in part."""
    return max((len(s) for s in stops), default=1) - 1
