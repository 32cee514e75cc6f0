"""The arithmetic task's tokenizer: byte-level BPE trained on the task corpus, one token per digit
(a number's leading space rides on its first digit).

The chat template renders user and assistant turns only: the bundled models were trained without
a system prompt, so a system message (Search-and-Learn's instruction) is left out rather than
shown to a model that never saw one.
"""
from __future__ import annotations

from treeserve.tasks.arithmetic import generate

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] != 'system' %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def task_corpus(num_problems: int = 2000, seed: int = 0) -> list[str]:
    problems = generate("train", num_problems, seed)
    return [p.text for p in problems] + [p.solution for p in problems] + ["+", "-"]


def train_task_tokenizer(vocab_size: int = 400, seed: int = 0):
    """A `PreTrainedTokenizerFast` whose end-of-sequence token is the end of a chat turn."""
    return train_bpe_tokenizer(task_corpus(seed=seed), vocab_size, SPECIAL_TOKENS, "<|end|>", CHAT_TEMPLATE)


def train_bpe_tokenizer(corpus: list[str], vocab_size: int, special_tokens: list[str], eos_token: str,
                        chat_template: str, digits: str = " ?[0-9]", pieces: str | None = None):
    """Byte-level BPE over `corpus`, one digit per token (by default a number's leading space rides
    on its first digit; `digits="[0-9]"` keeps digits bare, so a number reads the same tokens
    wherever it stands); `special_tokens` start with the pad and bos tokens. `pieces`, where given,
    is the regex whose matches are the words BPE merges within (instead of GPT-2's word split):
    it must match every character of any text, a digit alone."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(digits), behavior="isolated"),  # one digit per token
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ]) if pieces is None else pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pieces), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=special_tokens[0], bos_token=special_tokens[1],
                                   eos_token=eos_token, clean_up_tokenization_spaces=False)
    fast.chat_template = chat_template
    return fast
