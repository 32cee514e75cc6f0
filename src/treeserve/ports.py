"""TCP ports for the servers a command starts: a free one picked, or the one asked for checked before
anything slow happens (a model loaded, a child started), so that a taken port is an error naming it
and its flag rather than a child dying with EADDRINUSE while something else answers there."""
from __future__ import annotations

import socket


class PortInUseError(OSError):
    """The port a command was told to use is taken."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def ensure_port_free(host: str, port: int, flag: str) -> None:
    """Raises PortInUseError naming `port` and `flag` if binding it would fail. SO_REUSEADDR as
    uvicorn sets it: a port held only by closed connections (TIME_WAIT) counts as free."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            raise PortInUseError(f"{host}:{port} is already in use ({error.strerror}): stop what listens there "
                                 f"or pass another {flag}") from None
