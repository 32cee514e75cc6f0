"""Grammar engines for structured outputs, measured on one tokenizer: llguidance (what treeserve
uses), xgrammar (vLLM's default), outlines-core. Whichever of them is installed here runs.

For each JSON schema (with a valid instance written below) and each engine: the time to compile
the schema, and the time to compute the allowed-token bitmask before each token of the instance,
fed token by token (the sampler's per-step work), whitespace between JSON tokens allowed in both.
Prints medians per engine.
outlines-core is given the tokenizer's vocabulary as its raw token strings (its `from_pretrained`
reads the hub); its masks are then approximate for byte-level tokens, its timings are not.

    python benchmarks/grammar_engines.py [--tokenizer DIR] [--vocab 32000]

Without --tokenizer (nothing is downloaded), a byte-level BPE of --vocab tokens is trained here on
the Python standard library's sources, so that masks are computed over a vocabulary of a real
model's size (the benchmark models' own tokenizers have 512 tokens).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

CASES = [
    ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
      "required": ["name", "age"], "additionalProperties": False}, '{"name": "Ada Lovelace", "age": 36}'),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
      "required": ["tags"]}, '{"tags": ["red", "green", "blue", "yellow"]}'),
    ({"type": "object", "properties": {"kind": {"enum": ["circle", "square"]}, "size": {"type": "number"},
                                       "meta": {"type": "object", "properties": {"id": {"type": "string",
                                                                                        "pattern": "^[a-z]{3}[0-9]{2}$"}},
                                                "required": ["id"]}}, "required": ["kind", "size", "meta"]},
     '{"kind": "circle", "size": 2.5, "meta": {"id": "abc12"}}'),
    ({"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                 "required": ["x", "y"]}},
     '[{"x": 1, "y": 2}, {"x": 30, "y": 40}, {"x": 500, "y": 600}, {"x": 7, "y": 8}]'),
]


def timed_walk(ids, mask, consume) -> list[float]:
    """Times `mask()` before each token, then feeds the token with `consume(token) -> accepted`."""
    times = []
    for tid in ids:
        start = time.perf_counter()
        mask()
        times.append(time.perf_counter() - start)
        if not consume(tid):
            raise RuntimeError(f"the grammar rejected token {tid}")
    return times


def llguidance_engine(tokenizer, vocab):
    import llguidance
    import llguidance.hf
    import llguidance.torch as llg_torch
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile_(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                 defaults={"whitespace_flexible": True})
        return llguidance.LLMatcher(lltok, grammar)

    def walk(matcher, ids):
        bitmask = llg_torch.allocate_token_bitmask(1, vocab)
        return timed_walk(ids, lambda: llg_torch.fill_next_token_bitmask(matcher, bitmask, 0), matcher.consume_token)
    return compile_, walk


def xgrammar_engine(tokenizer, vocab):
    import xgrammar as xgr
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab),
                                   cache_enabled=False)

    def compile_(schema):
        return xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=True))

    def walk(matcher, ids):
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        return timed_walk(ids, lambda: matcher.fill_next_token_bitmask(bitmask, 0), matcher.accept_token)
    return compile_, walk


def outlines_engine(tokenizer, vocab):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    eos = tokenizer.eos_token_id
    tokens: dict[str, list[int]] = {}
    for token, tid in tokenizer.get_vocab().items():
        if tid != eos:
            tokens.setdefault(token, []).append(tid)
    vocabulary = Vocabulary(eos, tokens)

    def compile_(schema):
        return Guide(Index(build_regex_from_schema(json.dumps(schema)), vocabulary))

    def walk(guide, ids):
        times = []
        for tid in ids:
            start = time.perf_counter()
            guide.get_tokens()
            times.append(time.perf_counter() - start)
            try:
                guide.advance(tid)
            except Exception:  # its raw-string vocabulary differs from the tokenizer on byte-level tokens
                break
        return times
    return compile_, walk


def trained_tokenizer(vocab_size: int):
    import sysconfig
    from pathlib import Path

    from treeserve.model.random_models import train_tokenizer
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    return train_tokenizer(vocab_size, corpus=(p.read_text(errors="replace") for p in sources))


ENGINES = {"llguidance": llguidance_engine, "xgrammar": xgrammar_engine, "outlines-core": outlines_engine}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer directory")
    parser.add_argument("--vocab", type=int, default=32000, help="size of the BPE trained without --tokenizer")
    args = parser.parse_args()
    import transformers
    if args.tokenizer:
        tokenizer, source = transformers.AutoTokenizer.from_pretrained(args.tokenizer), args.tokenizer
    else:
        tokenizer, source = trained_tokenizer(args.vocab), "byte-level BPE trained on the standard library"
    vocab = len(tokenizer)
    torch.set_num_threads(1)
    print(f"tokenizer: {source} ({vocab} tokens); {len(CASES)} JSON schemas, masks along a valid instance")
    for name, make in ENGINES.items():
        try:
            start = time.perf_counter()
            compile_, walk = make(tokenizer, vocab)
            setup = time.perf_counter() - start
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        compiles, masks = [], []
        for schema, instance in CASES:
            start = time.perf_counter()
            matcher = compile_(schema)
            compiles.append(time.perf_counter() - start)
            masks += walk(matcher, tokenizer.encode(instance, add_special_tokens=False))
        print(f"{name}: tokenizer setup {setup * 1e3:.0f} ms; compile per schema median {statistics.median(compiles) * 1e3:.2f} "
              f"ms (max {max(compiles) * 1e3:.2f}); mask per token median {statistics.median(masks) * 1e6:.0f} us "
              f"(p90 {sorted(masks)[int(0.9 * len(masks))] * 1e6:.0f} us, {len(masks)} masks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
