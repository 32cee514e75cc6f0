"""Edit and Regenerate replace nothing until the new answer has begun: the request goes to the model
first, and only once something of the answer has come back are the old messages replaced. A new answer
refused before that (a full queue, a budget, a rate limit, a context too small) is an HTTP error, as a
refused request is, and the conversation is as it was: the old answer stays (OpenAI's ChatGPT keeps the
old answer when a regeneration fails)."""
from __future__ import annotations

from collections.abc import AsyncIterator

from treeserve.gateway.chat.upstream import UpstreamError
from treeserve.wire.errors import APIError

# what a mode says before any model has answered (tools mode: the router is being asked)
NOTICES = frozenset({"routing"})


async def first_output(mode: AsyncIterator[dict]) -> list[dict]:
    """The mode's events up to its first output, the notices before it included (all of them if it
    ends without any output). Refused or failed before that: APIError with the refusal's status, code
    and message, the mode closed."""
    events: list[dict] = []
    try:
        async for event in mode:
            events.append(event)
            if event.get("type") not in NOTICES:
                break
    except UpstreamError as exc:
        await mode.aclose()
        raise APIError(exc.status, str(exc), code=exc.code) from None
    except BaseException:
        await mode.aclose()
        raise
    return events
