"""A message's role as chat templates read it: OpenAI's `developer` (its newer name for the
instructions a `system` message carries) is rendered as `system`, which the templates of open models
know and `developer` they do not. One mapping for the server's messages and the offline `LLM.chat`'s."""
from __future__ import annotations

TEMPLATE_ROLES = {"developer": "system"}


def template_role(role):
    """The role a chat template is given for a message of `role` (other values pass as they are)."""
    return TEMPLATE_ROLES.get(role, role) if isinstance(role, str) else role
