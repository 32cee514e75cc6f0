"""TCP ports for the servers a command starts: a free one picked, or the one asked for bound before
anything slow happens (a model loaded, a child started), so that a taken port is an error naming it
and its flag rather than a child dying with EADDRINUSE while something else answers there. A server
that serves in this process keeps the sockets it bound (`bind_sockets`) and hands them to uvicorn, as
vLLM's `serve` does: nothing can take the port while its models load."""
from __future__ import annotations

import contextlib
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
    if binding fails for another reason (for a port a child process will bind)."""
    for sock in bind_sockets(host, port, flag):
        sock.close()


def bind_sockets(host: str, port: int, flag: str) -> list[socket.socket]:
    """Sockets bound, not yet listening (a client gets "connection refused" until the server serves),
    on every address the host resolves to, each in its own family, as uvicorn's server binds them
    (`::` and `::1` as IPv6); for `uvicorn.Server.run(sockets=...)`. Errors as `ensure_port_free`."""
    bound: list[socket.socket] = []
    try:
        for family, kind, proto, _, sockaddr in _addresses(host, port):
            bound.append(_bind(family, kind, proto, sockaddr))
    except OSError as error:
        for sock in bound:
            sock.close()
        raise _unavailable(host, port, flag, error) from None
    return bound


def ready_to_serve(sockets: list[socket.socket]) -> list[socket.socket]:
    """SO_REUSEADDR set on sockets from `bind_sockets` as the server is about to listen on them (as
    uvicorn sets it): the connections it accepts inherit it, so that those it closes first (TIME_WAIT)
    do not keep its next start from binding the port. Set earlier, another server could bind the
    port while ours waits unlistened."""
    for sock in sockets:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sockets


@contextlib.contextmanager
def closing_all(sockets: list[socket.socket]):
    """The sockets closed on the way out (uvicorn closes those it served on; the others, here)."""
    try:
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def _addresses(host: str, port: int) -> list[tuple]:
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return list(dict.fromkeys(found))  # (a name may resolve to one address twice)


def _bind(family: int, kind: int, proto: int, sockaddr: tuple) -> socket.socket:
    """Bound without SO_REUSEADDR first: then no other socket can bind the port, even one that sets it
    (uvicorn's), while ours waits unlistened. Only if that fails, bound again with SO_REUSEADDR as
    uvicorn sets it: a port held only by closed connections (TIME_WAIT) counts as free, a listener
    does not; the option cleared once bound, so that the port is held as firmly as by the first bind."""
    try:
        return _bound(family, kind, proto, sockaddr, reuse=False)
    except OSError as error:
        if error.errno != errno.EADDRINUSE:
            raise
    sock = _bound(family, kind, proto, sockaddr, reuse=True)
    # cleared once bound: a later bind is checked against our socket's option as it is then, and left set,
    # another server's (uvicorn's SO_REUSEADDR bind, or this fallback's) would share the port, and could
    # listen on it, while ours waits unlistened; `ready_to_serve` sets it again
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    return sock


def _bound(family: int, kind: int, proto: int, sockaddr: tuple, reuse: bool) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
        if family == socket.AF_INET6:  # (as asyncio's create_server: `::` alone, not IPv4 as well)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
    except OSError:
        sock.close()
        raise
    return sock


def _unavailable(host: str, port: int, flag: str, error: OSError) -> PortUnavailableError:
    reason = error.strerror or str(error)
    if error.errno == errno.EADDRINUSE:
        return PortInUseError(f"{address(host, port)} is already in use ({reason}): stop what listens there "
                              f"or pass another {flag}")
    return PortUnavailableError(f"cannot listen on {address(host, port)} ({reason})")
