"""Structured outputs: a grammar engine (llguidance) decides which tokens may come next.

Each constrained sequence holds an `LLMatcher`, the grammar's state after its tokens so far. Before
sampling, the sampler asks every constrained row of the batch for its allowed-token bitmask and
sets the other logits to -inf in one batched `masked_fill` (`apply`); unconstrained rows share the batch
untouched. After sampling, the chosen token advances the matcher (`advance`); a grammar that can
only end stops the sequence. Grammars compile once per source (kind and text): compiled matchers
are kept, least recently used first out, and each request gets a copy.

llguidance builds its token trie from the tokenizer (`tokenizer.json`), has no required
dependencies, and compiles JSON schemas lazily (the first tokens are masked while the rest of the
grammar is still unbuilt); docs/STRUCTURED_OUTPUTS.md says how it was chosen.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import importlib
from typing import TYPE_CHECKING

import torch

from treeserve.engine.json_schema_strict import strict_schema_text
from treeserve.errors import ParamError
from treeserve.model.transfer import to_device
from treeserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

CACHE_SIZE = 256  # compiled grammars kept per engine
# JSON without free whitespace between tokens (llguidance's default allows any): small models
# otherwise spend their tokens on runs of spaces and newlines. A schema may say otherwise with
# llguidance's "x-guidance" key ({"whitespace_flexible": true}).
JSON_DEFAULTS = {"whitespace_flexible": False}
_BIT_INDEX = torch.arange(32, dtype=torch.int32)
LOGGED_ERROR_CHARS = 500
logger = logging.getLogger(__name__)


class StructuredOutputs:
    """One engine's grammar engine: its tokenizer (built on first use) and compiled grammars."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._hf_tokenizer, self._eos = hf_tokenizer, list(eos_token_ids)
        # The grammar engine's vocabulary: the model's, or the tokenizer's where it has more tokens
        # (a token the model cannot sample is never allowed in practice; the mask is cut to the logits).
        self.vocab_size = max(vocab_size, len(hf_tokenizer))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles in its own threads, the engine loop in its

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = _llguidance("hf").from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self._eos or None)
        return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled grammar (cached); ParamError naming what the grammar engine rejected."""
        key = spec.source()
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
            matcher = self._build(*key)
            self._compiled[key] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return matcher

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence."""
        return self.compile(spec).deep_copy()

    def _build(self, kind: str, text: str) -> llguidance.LLMatcher:
        llguidance = _llguidance()
        param = "structured_outputs." + {"json_schema": "json", "choice": "choice"}.get(kind, kind)
        try:
            if kind == "json_schema":
                # (strict, as vLLM's default: an object takes only the keys it lists unless it says otherwise)
                grammar = llguidance.LLMatcher.grammar_from_json_schema(strict_schema_text(text), defaults=JSON_DEFAULTS)
            else:
                grammar = llguidance.grammar_from(kind, text)
        except ValueError as exc:
            raise ParamError(param, f"the grammar engine cannot read it: {exc}") from exc
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ParamError(param, f"the grammar engine cannot compile it: {error.strip()}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ParamError(param, f"the grammar engine cannot compile it: {matcher.get_error().strip()}")
        return matcher


def _llguidance(submodule: str = ""):
    """The grammar engine, imported where a grammar is first compiled: an engine that serves no
    structured output runs without it (the GPU machine's image has no llguidance)."""
    return importlib.import_module("llguidance" + (f".{submodule}" if submodule else ""))


def bitmask(matchers: list[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """The matchers' allowed tokens now, as llguidance's packed bitmask (one int32 row each)."""
    words = (vocab_size + 31) // 32
    out = torch.full((len(matchers), words), -1, dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        fill_bitmask(matcher, out[row])
    return out


def apply(logits: torch.Tensor, matchers: list[llguidance.LLMatcher | None]) -> None:
    """Each constrained row's grammar mask on its logits, in place (rows without a matcher are free)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if rows:
        apply_bitmask(logits, rows, bitmask([matchers[i] for i in rows], logits.shape[1]))


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Sets to -inf, in place, the logits of tokens that row `rows[j]`'s grammar (bitmask row j) forbids."""
    forbidden = ~to_device(allowed_tokens(bitmask, logits.shape[1]), logits.device)  # (pinned: no wait)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = to_device(torch.tensor(rows), logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(forbidden, float("-inf")))


def fill_bitmask(matcher: llguidance.LLMatcher, row: torch.Tensor) -> None:
    """The matcher's allowed tokens into one contiguous int32 row of a CPU bitmask."""
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's packed bitmask ([rows, ceil(vocab / 32)] int32, bit i of word w for token
    32 w + i) as [rows, vocab_size] bool. (llguidance's own `llguidance.torch` module applies it
    with a `torch.compile`d kernel: importing it loads the compiler stack, and the first call
    compiles for seconds, for what is one vectorised shift here.)"""
    bits = (bitmask.unsqueeze(-1) >> _BIT_INDEX) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def draft_bitmasks(matcher: llguidance.LLMatcher, drafts: list[int], vocab_size: int) -> torch.Tensor:
    """What the grammar allows at each position a draft is verified at: now, and after each of the
    `drafts` (which it must accept: `valid_draft`); the matcher is left as it was."""
    words = (vocab_size + 31) // 32
    out = torch.full((len(drafts) + 1, words), -1, dtype=torch.int32)
    fill_bitmask(matcher, out[0])
    for i, token in enumerate(drafts, start=1):
        matcher.consume_token(token)
        fill_bitmask(matcher, out[i])
    matcher.rollback(len(drafts))
    return out


def valid_draft(matcher: llguidance.LLMatcher, drafts: list[int]) -> list[int]:
    """The longest start of `drafts` the grammar accepts from its state now."""
    return drafts[:matcher.validate_tokens(drafts)] if drafts else drafts


def advance(matcher: llguidance.LLMatcher, token_id: int) -> str | None:
    """Feeds the sampled token to the grammar: "stop" when it is complete, None to go on, or what
    the grammar engine said when it failed (the mask forbade nothing it would then reject: a
    grammar past its limits, such as a row of 2,000 alternatives), which ends the sequence as an error."""
    if not matcher.consume_token(token_id):
        error = matcher.get_error() or "it rejected a token its own mask allowed"
        cut = error if len(error) <= LOGGED_ERROR_CHARS else error[:LOGGED_ERROR_CHARS] + " ..."
        logger.error("the grammar rejected sampled token %d (%s); the sequence ends with an error", token_id, cut)
        return cut
    return "stop" if matcher.is_stopped() else None
