"""Incremental detokenization equals a full decode, including multi-byte UTF-8 split across tokens."""
import random

import pytest

from treeserve.engine.detokenizer import IncrementalDetokenizer, find_stop_string, stop_hold_back
from treeserve.testing.tiny_models import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(vocab_size=300)


def _stream(tokenizer, prompt_ids, ids):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detok.push(t) for t in ids]
    pieces.append(detok.flush())
    return pieces, detok.text


@pytest.mark.parametrize("text", ["café naïve", "日本語 中文 😀🚀", "Привет, Ωμέγα — €5", "plain words only"])
def test_incremental_matches_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces, streamed = _stream(tokenizer, tokenizer.encode("Hello"), ids)
    assert streamed == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_random_byte_tokens(tokenizer):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 30))]
        _, streamed = _stream(tokenizer, [], ids)
        assert streamed == tokenizer.decode(ids, skip_special_tokens=True)


def test_multibyte_character_split_over_byte_tokens(tokenizer):
    ids = tokenizer.encode("🦀")  # not in the training corpus: one byte-level token per UTF-8 byte
    assert len(ids) == 4
    pieces, streamed = _stream(tokenizer, [], ids)
    assert streamed == "🦀"
    assert pieces[:4] == ["", "", "", "🦀"]


def test_stop_string_search():
    assert find_stop_string("abc STOP def", 12, ("STOP",)) == ("STOP", 4)
    assert find_stop_string("abc STOP", 2, ("STOP", "abc")) == ("STOP", 4)
    assert find_stop_string("abc", 3, ("zz",)) is None
    assert stop_hold_back(("STOP", "ab")) == 3


def test_fast_decode_equals_the_tokenizers_decode(tokenizer, tiny_model_dirs):
    """The Rust tokenizer's decode stands in for the wrapper only where they agree: the bundled
    and tiny-model tokenizers, special tokens kept or skipped; one that cleans up spaces keeps
    the wrapper."""
    from transformers import AutoTokenizer

    from treeserve.engine.detokenizer import fast_decode
    from treeserve.model.registry import DEFAULT_GENERATOR, resolve_model_path
    rng = random.Random(1)
    tokenizers = [tokenizer, AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_GENERATOR))]
    tokenizers += [AutoTokenizer.from_pretrained(tiny_model_dirs[family]) for family in ("llama", "qwen2")]
    for tok in tokenizers:
        decode = fast_decode(tok)
        assert decode == tok._tokenizer.decode  # the fast path is taken
        for _ in range(40):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 20))] + list(tok.all_special_ids)[:1]
            for skip in (True, False):
                assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)
    tokenizer.clean_up_tokenization_spaces = True
    try:
        ids = tokenizer.encode("a , b .")
        assert fast_decode(tokenizer) != tokenizer._tokenizer.decode
        assert fast_decode(tokenizer)(ids, True) == tokenizer.decode(ids, skip_special_tokens=True)
    finally:
        tokenizer.clean_up_tokenization_spaces = False
