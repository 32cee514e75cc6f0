"""Tiny random-weight checkpoints for tests; the writer lives in `treeserve.model.random_models`
(the `builtin:` models use it too, and only tests import this package)."""
from treeserve.model.random_models import (BUILTIN_TINY_MODELS, CHAT_TEMPLATE, FAMILIES, GEMMA_FAMILIES,  # noqa: F401
                                           GEMMA_WINDOW, MOE_FAMILIES,
                                           SPECIAL_TOKENS, make_tiny_eagle_head, make_tiny_model, make_tiny_reward_model, train_tokenizer,
                                           training_corpus)
