"""Chat rendering in one place: messages (and tools) through the chat template to prompt text."""
from __future__ import annotations

import inspect
import logging
import re
from pathlib import Path

from treeserve.errors import ParamError
from treeserve.template_roles import template_role
from treeserve.tool_arguments import parse_arguments

logger = logging.getLogger(__name__)


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


def renders_tools(template: str | dict | None) -> bool:
    """Whether a chat template uses the `tools` it is given (HF tokenizers may hold named templates)."""
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any(re.search(r"\btools\b", text) for text in texts)


def warn_replaced_tool_templates(tokenizers: dict, chat_template: str | None, source: str | None) -> list[str]:
    """`--chat-template` replaces every served model's own template: a warning for each model whose
    own template renders tools, since a model trained on its own tool format writes garbled calls in
    another one. Returns the names of the models warned about."""
    if chat_template is None:
        return []
    where = source if source and Path(source).is_file() else "the --chat-template text"
    owns = {name: getattr(tokenizer, "chat_template", None) for name, tokenizer in tokenizers.items()}
    names = [name for name, own in owns.items() if own != chat_template and renders_tools(own)]
    for name in names:
        logger.warning("model %r: --chat-template %s replaces the model's own chat template, which renders tools; "
                       "a model writes tool calls best in the format it was trained on, so leave --chat-template "
                       "out for it (it is for models whose own template lacks tools)", name, where)
    return names


# apply_chat_template's own arguments: what the request's fields set, never a template variable
RENDER_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                              "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors"})


def render_chat(tokenizer, conversation: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, chat_template: str | None = None,
                continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
    """The prompt text of a conversation. Tools ({"type": "function", "function": {...}}, OpenAI's
    shape) go to the template as `tools`, as HF's `apply_chat_template` passes them. A template
    that fails on the conversation raises ParamError naming `messages`."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ParamError("messages", "this model's tokenizer has no chat template (tokenizer_config.json's chat_template "
                         "or chat_template.jinja; transformers has had no default one since 4.44); give one: "
                         "--chat-template FILE served, chat_template= offline")
    taken = sorted(set(template_kwargs or ()) & (RENDER_ARGUMENTS | _render_parameters(tokenizer)))
    if taken:
        raise ParamError("chat_template_kwargs", f"{', '.join(taken)} cannot be given here: the request's own "
                         "fields set them")
    try:
        return tokenizer.apply_chat_template(conversation, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                                             continue_final_message=continue_final_message, **(template_kwargs or {}))
    except Exception as exc:  # a template may reject a conversation (roles out of order, say)
        raise ParamError("messages", f"the chat template failed ({exc})") from exc


def _render_parameters(tokenizer) -> frozenset[str]:
    """apply_chat_template's own named parameters (padding, truncation, ...: not template variables)."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return frozenset(p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def template_messages(conversation: list[dict]) -> list[dict]:
    """Messages as OpenAI's client writes them, made what chat templates read (as vLLM's `LLM.chat`
    does): a `developer` message becomes a `system` one (as the server's, template_roles.py), a
    content given as parts becomes their texts joined by newlines, and an assistant's
    tool-call arguments (JSON text) become the object HF templates expect. The caller's dicts are
    left as they are; ParamError names what no text model can render."""
    if not isinstance(conversation, (list, tuple)):
        raise ParamError("messages", f"expected a list of messages, got {type(conversation).__name__}")
    return [_template_message(message, f"messages[{i}]") for i, message in enumerate(conversation)]


def _template_message(message, where: str) -> dict:
    if not isinstance(message, dict):
        raise ParamError(where, f"expected a message dict with role and content, got {type(message).__name__}")
    if not isinstance(message.get("role"), str):
        raise ParamError(f"{where}.role", f"every message needs a role ('system', 'user', 'assistant', 'tool'), "
                                          f"got {message.get('role')!r}")
    message = dict(message)
    message["role"] = template_role(message["role"])
    if isinstance(message.get("content"), (list, tuple)):
        message["content"] = "\n".join(_part_text(part, f"{where}.content[{j}]")
                                       for j, part in enumerate(message["content"]))
    if message.get("tool_calls"):
        message["tool_calls"] = [_template_call(call, f"{where}.tool_calls[{j}]")
                                 for j, call in enumerate(message["tool_calls"])]
    return message


def _part_text(part, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise ParamError(where, f"only text parts ({{'type': 'text', 'text': ...}}) can be rendered for a text model, "
                            f"got {part!r:.80}")


def _template_call(call, where: str):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call  # (already an object, as HF's own examples write it)
    return {**call, "function": {**function, "arguments": parse_arguments(function["arguments"], where)}}
