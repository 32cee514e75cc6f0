"""Running the gateway's app: uvicorn with the drain of wire/drain.py (`treeserve gateway` and
`treeserve chat`)."""
from __future__ import annotations

import sys

from treeserve.ports import ready_to_serve
from treeserve.wire.drain import DrainingServer, uvicorn_config


def run_gateway(app, host: str, port: int, watch=None, sockets=None) -> int:
    """Serves the gateway app until SIGTERM or SIGINT, then drains it (wire/drain.py); its spend
    logs are written before this returns, a second signal's exit included. 1 if it could not start.
    `watch(server)`, called before it starts, may stop it from another thread (`server.should_exit`).
    `sockets`: bound already for `host` and `port` (ports.bind_sockets), before the app was built."""
    # The event loop hands the GIL to the settlement writer and worker threads in 1 ms turns, not 5.
    sys.setswitchinterval(0.001)
    # uvloop and httptools: the event loop and HTTP parser in C (a relayed stream is many small writes)
    server = DrainingServer(uvicorn_config(app, host=host, port=port, log_level="info", loop="uvloop",
                                           http="httptools", access_log=False),  # the app logs requests, no query
                            app.state.drain, name="gateway")
    if watch is not None:
        watch(server)
    try:
        server.run(sockets=ready_to_serve(sockets) if sockets is not None else None)
    finally:
        app.state.store.close()  # (done already unless a second signal skipped the app's shutdown)
    return 0 if server.started else 1
