"""POST /v1/completions: the request body."""
from __future__ import annotations

from treeserve.errors import ParamError
from treeserve.wire.sampling_request import SamplingRequest, top_count


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: per prompt token, returned in each choice's `prompt_logprobs`
    tools: list[dict] | None = None     # chat completions only: named in a 400 here
    tool_choice: str | dict | None = None

    def reject_unimplemented(self) -> None:
        choice = None if self.tool_choice == "none" else self.tool_choice
        for name, value in (("tools", self.tools), ("tool_choice", choice)):
            if value is not None:
                raise ParamError(name, "is for /v1/chat/completions; completions have no tools")
        super().reject_unimplemented()

    def requested_logprobs(self) -> int | None:
        if self.suffix is not None:
            raise ParamError("suffix", "is not supported")
        return top_count("logprobs", self.logprobs)

    def requested_prompt_logprobs(self) -> int | None:
        """With `echo`, `logprobs` covers the echoed prompt too (OpenAI's legacy completions)."""
        top_count("prompt_logprobs", self.prompt_logprobs)
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def requested_max_tokens(self) -> int:
        """What the engine generates: `max_tokens: 0` (echo only) generates one token, left out of the reply."""
        if self.max_tokens is None:
            return 16
        if self.max_tokens < 1 and not (self.max_tokens == 0 and self.echo):
            raise ParamError("max_tokens", f"must be >= 1 (0 only with echo: the prompt alone), got {self.max_tokens}")
        return max(self.max_tokens, 1)

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ParamError("prompt", "must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)
