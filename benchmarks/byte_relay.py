"""The cheapest relay there is: the bytes of each connection piped both ways to a backend, with no
HTTP parsing, no key check, no accounting (uvloop). `gateway_overhead.py --floor` runs the same
load through it: what any Python proxy on this machine costs before it does any of a gateway's work.

    python benchmarks/byte_relay.py LISTEN_PORT BACKEND_PORT
"""
from __future__ import annotations

import asyncio
import sys

import uvloop


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def main(listen: int, backend: int) -> None:
    async def relay(client_reader, client_writer):
        backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", backend)
        await asyncio.gather(pipe(client_reader, backend_writer), pipe(backend_reader, client_writer))

    server = await asyncio.start_server(relay, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), int(sys.argv[2])))
