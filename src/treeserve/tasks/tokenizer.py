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
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(" ?[0-9]"), behavior="isolated"),  # one digit per token, with its space
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(task_corpus(seed=seed), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|end|>",
                                   pad_token="<|pad|>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast
