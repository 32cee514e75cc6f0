"""A client that leaves before its answer is ready: the work for it stops instead of running to an
answer nobody reads, as vLLM's server does (the server aborts its engine requests; the gateway its
upstream request, billed as closed by its client). A stream under way stops by itself (its response
sees the disconnect); this covers a whole answer, and a stream's wait for its first event.

A request with an `Idempotency-Key` runs to its end even so: its repeat is answered with it
(server/idempotency.py), as a gateway's batch line sent again after the gateway died is."""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from fastapi import Request

from treeserve.wire.errors import APIError

T = TypeVar("T")


async def unless_client_leaves(request: Request, work: Awaitable[T], what: str = "answer",
                               idempotent: bool = True) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled and the request ends
    with a 499 that nobody reads (and no error in the server's log). The request's body must have
    been read already: what comes next on its channel is the disconnect. `idempotent`: this server
    answers a repeat of an Idempotency-Key (the gateway does not: there the header changes nothing)."""
    if idempotent and request.headers.get("idempotency-key"):
        return await work
    task, left = asyncio.ensure_future(work), asyncio.ensure_future(client_left(request))
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # (its end, whatever it is; this handler's own cancellation still raises)
            if not task.cancelled():
                task.exception()  # (retrieved: an error it raised on its way out is not logged as unread)
            raise APIError(499, f"the client closed the request before its {what} was ready",
                           code="client_closed_request")
        return task.result()
    finally:
        left.cancel()
        task.cancel()  # (a no-op once done; this handler cancelled itself: the work goes with it)


async def client_left(request: Request) -> None:
    """Returns when the client disconnects (its body already read, the next ASGI message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
