"""Chat rendering in one place: messages (and tools) through the chat template to prompt text."""
from __future__ import annotations

from pathlib import Path

from treeserve.errors import ParamError


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's path, or the Jinja template itself."""
    if value is None:
        return None
    path = Path(value)
    if path.suffix in (".jinja", ".j2", ".txt") or path.is_file():
        if not path.is_file():
            raise ParamError("chat_template", f"no such file: {value}")
        return path.read_text()
    if "{" not in value:
        raise ParamError("chat_template", f"{value!r} is neither a file nor a Jinja template")
    return value


def render_chat(tokenizer, conversation: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, chat_template: str | None = None) -> str:
    """The prompt text of a conversation. Tools ({"type": "function", "function": {...}}, OpenAI's
    shape) go to the template as `tools`, as HF's `apply_chat_template` passes them. A template
    that fails on the conversation raises ParamError naming `messages`."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ParamError("messages", "this model's tokenizer has no chat template; give one (--chat-template)")
    try:
        return tokenizer.apply_chat_template(conversation, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, chat_template=chat_template)
    except Exception as exc:  # a template may reject a conversation (roles out of order, say)
        raise ParamError("messages", f"the chat template failed ({exc})") from exc
