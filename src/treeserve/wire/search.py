"""POST /v1/search: the request body."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from treeserve.wire.chat_messages import ChatMessage

# Search-and-Learn's recipes go to n=256 (its Config has no bound); a search's candidates are generated
# in waves of the engine's max_num_seqs and its tree is kept as token ids, so a large n costs time, not
# KV memory. The bound (4x the study's largest) refuses a typo's millions with a 400 naming `n`.
MAX_SEARCH_N = 1024


class SearchRequest(BaseModel):
    """POST /v1/search: test-time search for one question (Search-and-Learn's parameters)."""
    # Every field of SearchConfig under its name there, with its default or None (the server chooses);
    # server/serving_search.py copies them across, tests/test_sampling_fields.py checks both. A field
    # it does not have is a 400 naming it: `max_iterations` for num_iterations, ignored, ran 40.
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None             # the generator; default: the one served (as a chat's)
    verifier: str | None = None          # the PRM; needed by every strategy but greedy and majority
    question: str | None = None
    messages: list[ChatMessage] | None = None  # alternative to question: system prompt + user question
    strategy: str = "beam"
    n: int = Field(default=4, ge=1, le=MAX_SEARCH_N)
    beam_width: int | None = None
    num_iterations: int = 40
    lookahead: int = 0
    temperature: float = 0.8
    top_p: float = 1.0
    max_tokens: int = 2048
    agg_strategy: str | None = None      # default: the verifier's declared aggregation, else "last"
    filter_duplicates: bool = False
    sort_completed: bool = False
    eos_sampling_at_max_depth: bool = False
    system_prompt: str | None = None
    seed: int = 0
    stream: bool = False                 # Server-Sent Events: progress events, then the result
    stream_options: dict | None = None   # (taken with no effect: usage is in the result; a gateway sends it)
    user: str | None = None              # (OpenAI's end-user id: no effect)
    # speculative decoding of the samples, as vLLM's speculative_config ({"method": "suffix", ...}): the
    # problem's sibling sequences are the drafts' source; off unless given
    speculative_config: dict | None = None
