"""The generator's prompt for a problem: S&L's chat (system prompt, question as user), templated."""
from __future__ import annotations

from treeserve.errors import ParamError
from treeserve.search.config import SearchConfig


def chat_messages(question: str, config: SearchConfig) -> list[dict]:
    messages = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
    return messages + [{"role": "user", "content": question}]


def prompt_text(tokenizer, question: str, config: SearchConfig) -> str:
    """The templated prompt; a partial solution is appended to it verbatim to continue it."""
    if not getattr(tokenizer, "chat_template", None):
        raise ParamError("generator", "the model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(chat_messages(question, config), tokenize=False, add_generation_prompt=True)


def prompt_token_ids(tokenizer, question: str, config: SearchConfig) -> list[int]:
    return tokenizer.encode(prompt_text(tokenizer, question, config), add_special_tokens=False)
