"""Errors every layer may raise; this module imports nothing from treeserve."""
from __future__ import annotations


class ParamError(ValueError):
    """A bad value for one named parameter. The message reads "param: detail", and `param` carries the
    name so that callers (the server's error body) need not parse it out of the text."""

    def __init__(self, param: str, detail: str):
        super().__init__(f"{param}: {detail}")
        self.param = param
        self.detail = detail


class ContextLengthError(ParamError):
    """A prompt, with the tokens asked of it, longer than the model's context: OpenAI's sentence and
    code (those LiteLLM and LangChain tell a context overflow by), after the parameter's name."""
    code = "context_length_exceeded"

    def __init__(self, param: str, max_model_len: int, prompt_tokens: int, completion_tokens: int):
        super().__init__(param, f"This model's maximum context length is {max_model_len} tokens. However, you "
                         f"requested {prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the messages, "
                         f"{completion_tokens} in the completion). Please reduce the length of the messages or "
                         "completion.")


def check_context_length(max_model_len: int, prompt_tokens: int, max_tokens: int | None = None,
                         prompt_param: str = "prompt") -> None:
    """Raises ContextLengthError when the prompt and `max_tokens` (at least one token: one is always
    generated) exceed `max_model_len`; it names `prompt_param` when the prompt alone is too long."""
    completion_tokens = max(max_tokens or 0, 1)
    if prompt_tokens + completion_tokens > max_model_len:
        param = prompt_param if prompt_tokens >= max_model_len else "max_tokens"
        raise ContextLengthError(param, max_model_len, prompt_tokens, completion_tokens)


class EngineDeadError(RuntimeError):
    """The engine loop failed (a tensor-parallel worker died, ...): every request it held, and every
    one after, fails with this; the server answers it as a 503 `engine_dead` naming the cause."""

    def __init__(self, cause: BaseException):
        super().__init__(f"the engine has failed ({cause}); restart the server")
        self.cause = cause


class EngineClosedError(RuntimeError):
    """A call that needs a closed engine's model or KV memory (`close()` freed them): the message
    names the engine and its model."""

    def __init__(self, engine: str, why: str = "close() freed its weights and KV cache"):
        super().__init__(f"engine {engine} is closed ({why}): build a new LLM, engine or Runtime to run more "
                         "requests (its stats() stay readable)")
        self.engine = engine
