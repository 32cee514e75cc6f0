"""LiteLLM's admin vocabulary that this gateway maps or refuses: its names for "every model", and the fields
of its keys and users this gateway does not have (a 400 `unsupported_parameter` saying so, through
wire/unsupported.py, rather than `unknown parameter`, which reads as a typo to a LiteLLM user; a team's are
team_routes.UNBUILT)."""
from __future__ import annotations

from treeserve.wire.unsupported import Unsupported

# LiteLLM's names for "every model" in a key's, user's or team's `models` (a team key's all-team-models: its
# team's, which hold it anyway): the list that allows every model here, the empty one
ALL_MODELS = frozenset({"all-proxy-models", "all-team-models"})


def every_model_as_empty(models: list[str]) -> list[str]:
    return [] if ALL_MODELS & set(models) else models


# LiteLLM's key fields this gateway does not have: a 400 saying so (null or empty: dropped), as USER_UNSUPPORTED
KEY_UNSUPPORTED = {
    "tags": Unsupported("spend tags and tag routing are not built here"),
    "allowed_routes": Unsupported("a key here reaches the model routes; the master key the admin API"),
    "guardrails": Unsupported("this gateway has no guardrails"),
    "model_max_budget": Unsupported("budgets here are per key, user and team, not per model"),
    "model_rpm_limit": Unsupported("rate limits here are per key, not per model"),
    "model_tpm_limit": Unsupported("rate limits here are per key, not per model"),
    "permissions": Unsupported("no key permissions here beyond its models"),
    "aliases": Unsupported("model aliases are not built here"),
    "config": Unsupported("no per-key config here"),
    "key_type": Unsupported("every key here calls models; the admin API takes the master key"),
    "send_invite_email": Unsupported("this gateway sends no email"),
    "organization_id": Unsupported("this gateway has no organizations"),
    "enforced_params": Unsupported("enforced params are not built here"),
}

# LiteLLM's user fields this gateway does not have: a 400 saying so (null or empty: dropped), as /team/new's
# (team_routes.UNBUILT); they were `unknown parameter`, which reads as a typo to a LiteLLM user
USER_UNSUPPORTED = {
    "user_email": Unsupported("users here have no email; name them by user_id"),
    "user_alias": Unsupported("users here have no alias; name them by user_id"),
    "user_role": Unsupported("no user roles here: the master key administers, a user's keys call models"),
    "teams": Unsupported("add the user to a team with /team/member_add"),
    "organization_id": Unsupported("this gateway has no organizations"),
    "send_invite_email": Unsupported("this gateway sends no email"),
}
