"""What the gateway's services refuse, in their own terms. Accounts, admission and the chat's storage
raise these; the app turns each into its HTTP answer in one place (gateway/http_errors.py). A
message reads "param: detail" where a field is at fault, as a ParamError's does."""
from __future__ import annotations

import datetime as dt


class GatewayError(Exception):
    """A refusal of the gateway's accounts, admission or chat storage; `param` names the field at fault."""

    request_id: str | None = None  # a refused request's id, once the request path has logged it

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class DatabaseUnavailable(GatewayError):
    """The database did not answer (down, unreachable, out of connections): try again shortly."""
    retry_after = 2

    def __init__(self):
        super().__init__("the gateway's database is unavailable: try again in a moment")


class UserExists(GatewayError):
    def __init__(self, user_id: str):
        super().__init__(f"user_id: user {user_id!r} already exists", "user_id")


class AliasTaken(GatewayError):
    """Another key has this key_alias (LiteLLM's rule: aliases are unique), or it is the master key's label."""

    def __init__(self, alias: str):
        super().__init__(f"key_alias: {alias!r} is taken (by another key, or the master key's label); "
                         "aliases are unique", "key_alias")


class KeyTaken(GatewayError):
    """A key chosen by an admin (/key/regenerate's `new_key`, /key/generate's `key`) is another key's secret."""

    def __init__(self, field: str = "new_key"):
        super().__init__(f"{field}: this key is taken; choose another (or leave {field} out for a random one)", field)


class AliasReserved(GatewayError):
    """Aliases starting with "chat:" name the web chat's keys: the admin API gives none to another key."""

    def __init__(self, alias: str, prefix: str):
        super().__init__(f"key_alias: {alias!r} is reserved: aliases starting with {prefix!r} name the web chat's "
                         "keys", "key_alias")


class ChatKeyOwner(GatewayError):
    """A web chat key stays with its user (the chat finds it by its user)."""

    def __init__(self, user_id: str):
        super().__init__(f"user_id: this key is user {user_id!r}'s web chat key; it cannot be given to another "
                         "user", "user_id")


class UserNotFound(GatewayError):
    def __init__(self, user_id: str):
        super().__init__(f"user_id: no user {user_id!r}", "user_id")


class KeyNotFound(GatewayError):
    """`param`: the field that named the key ("key", "api_key", "keys")."""

    def __init__(self, param: str = "key", message: str | None = None):
        super().__init__(message or f"{param}: no such key", param)


class KeysNotFound(KeyNotFound):
    """Some keys of a batch do not exist (and none of the batch was touched)."""

    def __init__(self, missing: int, param: str = "keys"):
        super().__init__(param, f"{param}: {missing} of the keys do not exist; none was deleted")


class TeamBlocked(GatewayError):
    """A key of a blocked team (LiteLLM's /team/block): refused, saying it is the team that is blocked."""

    def __init__(self, team_id: str):
        super().__init__(f"the key's team {team_id!r} is blocked: /team/unblock lets its keys in again")
        self.team_id = team_id


class TeamNotFound(GatewayError):
    def __init__(self, team_id: str, param: str = "team_id"):
        super().__init__(f"{param}: no team {team_id!r}", param)


class KeyTeamNotFound(TeamNotFound):
    """A key asked for a team that does not exist (a 400, as LiteLLM's /key/generate: the body is wrong)."""


class TeamExists(GatewayError):
    def __init__(self, team_id: str):
        super().__init__(f"team_id: team {team_id!r} already exists; use a different team_id", "team_id")


class ModelsOutsideTeam(GatewayError):
    """A team's key may be given only models of its team (LiteLLM's rule)."""

    def __init__(self, model: str, team_id: str, team_models: list[str]):
        super().__init__(f"models: {model!r} is not one of team {team_id!r}'s models {team_models}", "models")


class MemberExists(GatewayError):
    def __init__(self, user_id: str, team_id: str):
        super().__init__(f"member: user {user_id!r} is already in team {team_id!r}", "member")


class MemberNotFound(GatewayError):
    def __init__(self, user_id: str, team_id: str):
        super().__init__(f"user_id: user {user_id!r} is not in team {team_id!r}", "user_id")


class LimitExceeded(GatewayError):
    """A key's limit is reached; it may succeed again in `retry_after` seconds."""

    def __init__(self, message: str, param: str, retry_after: int):
        super().__init__(message, param)
        self.retry_after = retry_after


class ParallelLimitExceeded(LimitExceeded):
    def __init__(self, limit: int):
        super().__init__(f"max_parallel_requests: this key already has {limit} requests in flight",
                         "max_parallel_requests", retry_after=1)


class RateLimitExceeded(LimitExceeded):
    """`param` is rpm_limit or tpm_limit; `counted` what it counts ("requests", "tokens")."""

    def __init__(self, param: str, limit: int, counted: str, retry_after: int):
        super().__init__(f"{param}: this key's limit of {limit} {counted} per minute is reached", param, retry_after)


class BudgetExceeded(GatewayError):
    """`owner` is "key", "user" or "team". `spent`: the spend alone reached the budget (else what requests in
    flight hold filled it, and some of it may come back when they settle)."""

    def __init__(self, owner: str, spend: float, reserved: float, max_budget: float, spent: bool = True,
                 resets_at: dt.datetime | None = None):
        resets = f"; it resets at {resets_at.isoformat(timespec='seconds')}" if resets_at is not None else ""
        held = max(reserved, 0.0)  # (holds given back, a float sum, may leave a hair below 0: nothing is held)
        # ("Budget has been exceeded!": LiteLLM's proxy's words, which its users' clients look for)
        super().__init__(f"max_budget: Budget has been exceeded! The {owner}'s budget: spent {spend:.6f} (and "
                         f"{held:.6f} held by requests in flight or being settled) of max_budget {max_budget:.6f}"
                         f"{resets}", "max_budget")
        self.spent = spent


class AccountGone(GatewayError):
    """A key or user deleted after this process cached the key."""

    def __init__(self, owner: str):
        super().__init__(f"invalid API key: its {owner} no longer exists")


class ConversationNotFound(GatewayError):
    """Also what a conversation of another user is: ids cannot be probed."""

    def __init__(self):
        super().__init__("conversation: no such conversation", "conversation")


class MessageNotFound(GatewayError):
    """A message id that is not one of this conversation's (whoever's it is)."""

    def __init__(self, message_id: int):
        super().__init__(f"message_id: this conversation has no message {message_id}", "message_id")


class NothingToAnswer(GatewayError):
    """Edit or Regenerate asked of a message that is not the user's (or of a conversation with none)."""


class QuestionReplaced(GatewayError):
    """An answer whose question was edited or regenerated meanwhile: the answer is not stored."""

    def __init__(self):
        super().__init__("message_id: the question this answers was replaced", "message_id")


class ChatKeyBlocked(GatewayError):
    def __init__(self):
        super().__init__("your chat key is blocked or expired; ask the gateway's admin")


class FileNotFound(GatewayError):
    def __init__(self, file_id: str, param: str = "file_id"):
        super().__init__(f"{param}: no file {file_id!r} (never uploaded, deleted, or another key's)", param)


class BatchNotFound(GatewayError):
    def __init__(self, batch_id: str, param: str = "batch_id"):
        super().__init__(f"{param}: no batch {batch_id!r} (never created, or another key's)", param)


class BatchConflict(GatewayError):
    """A change the batch's state does not allow (cancelling a finished batch)."""
