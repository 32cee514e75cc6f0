"""TCP ports for the servers a command starts: a free one picked, or the one asked for checked before
anything slow happens (a model loaded, a child started), so that a taken port is an error naming it
and its flag rather than a child dying with EADDRINUSE while something else answers there."""
from __future__ import annotations

import errno
import socket


class PortUnavailableError(OSError):
    """The address a command was told to listen on cannot be bound (a host it cannot resolve or does
    not have, a port it may not use, ...)."""


class PortInUseError(PortUnavailableError):
    """The port a command was told to use is taken."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick); an IPv6 one for an IPv6 host."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def address(host: str, port: int) -> str:
    """HOST:PORT, an IPv6 host in brackets ([::1]:8000)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def ensure_port_free(host: str, port: int, flag: str) -> None:
    """Raises PortInUseError naming `port` and `flag` if something listens there, PortUnavailableError
    if binding fails for another reason. Every address the host resolves to is bound, in its own
    family, as uvicorn's server binds them (`::` and `::1` as IPv6). SO_REUSEADDR as uvicorn sets it:
    a port held only by closed connections (TIME_WAIT) counts as free."""
    try:
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                   flags=socket.AI_PASSIVE):
            _bind(family, kind, proto, sockaddr)
    except OSError as error:
        raise _unavailable(host, port, flag, error) from None


def _bind(family: int, kind: int, proto: int, sockaddr: tuple) -> None:
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # (as asyncio's create_server: `::` alone, not IPv4 as well)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)


def _unavailable(host: str, port: int, flag: str, error: OSError) -> PortUnavailableError:
    reason = error.strerror or str(error)
    if error.errno == errno.EADDRINUSE:
        return PortInUseError(f"{address(host, port)} is already in use ({reason}): stop what listens there "
                              f"or pass another {flag}")
    return PortUnavailableError(f"cannot listen on {address(host, port)} ({reason})")
