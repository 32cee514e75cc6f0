"""Where benchmark prompts come from: random token ids, ShareGPT JSON, custom JSONL, MATH-500.

Random prompts start with their own index written in token-id digits, so no two prompts of a run
share even their first token: the prefix cache cannot flatter a run unless shared prefixes are
asked for (`shared_prefix_len` tokens common to each of `shared_prefix_groups` buckets).
"""
from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path

from treeserve import jsonl
from treeserve.errors import ParamError

LOWEST_TOKEN_ID = 10  # skip the first ids, where tokenizers keep their special tokens
DEFAULT_VOCAB_SIZE = 256  # every byte-level vocabulary is larger (the bundled arith models: 337); --vocab-size or --tokenizer widen it
CHARS_PER_TOKEN = 4  # output length guess for a reference reply when no tokenizer is given
DATASETS = ("random", "sharegpt", "jsonl", "math500")


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int | None  # tokens, when known before sending (token-id prompts)
    output_len: int  # max_tokens asked for


@dataclass
class DatasetSpec:
    name: str = "random"
    path: str | None = None
    input_len: int = 256
    output_len: int | None = None  # None: 128 for random, the reference reply's length where one exists
    range_ratio: float = 0.0  # random lengths drawn from [len * (1 - r), len * (1 + r)]
    shared_prefix_len: int = 0
    shared_prefix_groups: int = 1
    vocab_size: int = DEFAULT_VOCAB_SIZE
    tokenizer: str | None = None
    seed: int = 0

    def __post_init__(self):
        if self.name not in DATASETS:
            raise ParamError("dataset", f"'{self.name}' is not one of {', '.join(DATASETS)}")
        if self.name != "random" and not self.path:
            raise ParamError("dataset_path", f"the '{self.name}' dataset needs a file path")
        if not 0 <= self.range_ratio < 1:
            raise ParamError("range_ratio", f"must be in [0, 1), got {self.range_ratio}")
        if self.input_len < 1 or (self.output_len is not None and self.output_len < 1):
            raise ParamError("input_len/output_len", f"must be >= 1, got {self.input_len}/{self.output_len}")
        if self.shared_prefix_groups < 1 or self.shared_prefix_len < 0:
            raise ValueError("shared_prefix_len must be >= 0 and shared_prefix_groups >= 1")
        if self.vocab_size <= LOWEST_TOKEN_ID + 1:
            raise ParamError("vocab_size", f"must exceed {LOWEST_TOKEN_ID + 1}, got {self.vocab_size}")


def sample_requests(spec: DatasetSpec, count: int, first_index: int = 0) -> list[SampleRequest]:
    """`count` requests; `first_index` keeps random prompts unique across the levels of one run."""
    if spec.name == "random":
        return random_requests(spec, count, first_index)
    rows = load_text_dataset(spec)
    if not rows:
        raise ParamError("dataset_path", f"{spec.path} holds no usable prompts")
    order = list(range(len(rows)))
    random.Random(spec.seed).shuffle(order)
    return [rows[order[(first_index + i) % len(rows)]] for i in range(count)]


def random_requests(spec: DatasetSpec, count: int, first_index: int) -> list[SampleRequest]:
    rng = random.Random(f"{spec.seed}:{first_index}")
    prefixes = [random_ids(random.Random(f"{spec.seed}:prefix:{g}"), spec.shared_prefix_len, spec.vocab_size)
                for g in range(spec.shared_prefix_groups)]
    output_len = spec.output_len or 128
    requests = []
    for i in range(count):
        index = first_index + i
        head = prefixes[index % len(prefixes)] + index_digits(index, spec.vocab_size)
        length = max(jittered(rng, spec.input_len, spec.range_ratio), len(head))
        prompt = head + random_ids(rng, length - len(head), spec.vocab_size)
        requests.append(SampleRequest(prompt, len(prompt), jittered(rng, output_len, spec.range_ratio)))
    return requests


def index_digits(index: int, vocab_size: int) -> list[int]:
    """`index` in base (vocab_size - LOWEST_TOKEN_ID), as token ids, always the same width."""
    base, digits = vocab_size - LOWEST_TOKEN_ID, []
    for _ in range(3):  # base**3 distinct prefixes, over 16 million for a 256-id vocabulary
        index, digit = divmod(index, base)
        digits.append(LOWEST_TOKEN_ID + digit)
    return digits


def random_ids(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(LOWEST_TOKEN_ID, vocab_size) for _ in range(length)]


def jittered(rng: random.Random, length: int, ratio: float) -> int:
    low, high = max(1, round(length * (1 - ratio))), max(1, round(length * (1 + ratio)))
    return rng.randint(low, high)


def load_text_dataset(spec: DatasetSpec) -> list[SampleRequest]:
    path = Path(spec.path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset_path: {path} does not exist")
    if spec.name == "sharegpt":
        pairs = sharegpt_pairs(json.loads(path.read_text()))
    else:
        field = "problem" if spec.name == "math500" else "prompt"
        pairs = jsonl_prompts(path, field)
    counter = token_counter(spec.tokenizer)
    return [SampleRequest(prompt, counter(prompt) if spec.tokenizer else None,
                          spec.output_len or reply_length(reply, counter) or 256)
            for prompt, reply in pairs]


def sharegpt_pairs(data: list) -> list[tuple[str, str | None]]:
    """First human turn and the reply that follows it, from ShareGPT's `conversations` format."""
    pairs = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        for first, second in zip(turns, turns[1:] + [None]):
            if first.get("from") in ("human", "user") and first.get("value"):
                pairs.append((first["value"], (second or {}).get("value")))
                break
    return pairs


def jsonl_prompts(path: Path, field: str) -> list[tuple[str, str | None]]:
    """Each line a JSON object with `field` (`prompt` for custom files) and an optional `output_len`."""
    pairs = []
    for number, line in jsonl.split(path.read_text()):
        row = json.loads(line)
        if field not in row:
            raise ParamError("dataset_path", f"line {number} of {path} has no '{field}' field")
        pairs.append((row[field], row.get("output_len")))
    return pairs


def token_counter(tokenizer: str | None):
    if tokenizer is None:
        return lambda text: max(1, round(len(text) / CHARS_PER_TOKEN))
    loaded = load_tokenizer(tokenizer)
    return lambda text: len(loaded.encode(text, add_special_tokens=False))


def reply_length(reply, counter) -> int | None:
    if isinstance(reply, int):
        return reply
    return counter(reply) if reply else None


def tokenizer_vocab_size(tokenizer: str) -> int:
    return len(load_tokenizer(tokenizer))


@functools.cache
def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
