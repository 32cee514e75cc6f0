"""JSON lines read and written by "\n" alone (treeserve.jsonl), against Python's json and httpx's
line splitter (what a client reading our server-sent events with `iter_lines` gets)."""
import json

import httpx

from treeserve import jsonl
from treeserve.search.evaluate import load_dataset

SEPARATORS = "\u2028\u2029\x85\x1c\x1d\x1e\x0b\x0c"  # what str.splitlines breaks at, besides \n and \r


def test_records_holding_every_splitlines_separator_come_back_whole():
    records = [{"text": f"x{sep}y", "n": i} for i, sep in enumerate(SEPARATORS)] + [{"text": "é ü 数"}]
    written = jsonl.dumps(records)
    assert len(written.splitlines()) == len(records) and "é ü 数" in written  # (UTF-8 text kept as it is)
    assert jsonl.loads(written) == records
    assert [json.loads(line) for line in written.splitlines()] == records


def test_raw_separators_inside_a_line_do_not_split_it_and_blank_lines_keep_their_numbers():
    text = json.dumps({"a": "1\u20282"}, ensure_ascii=False) + "\r\n\n  \n" + json.dumps({"b": "3\x854"}, ensure_ascii=False)
    assert jsonl.split(text) == [(1, '{"a": "1\u20282"}'), (4, '{"b": "3\x854"}')]
    assert jsonl.loads(text) == [{"a": "1\u20282"}, {"b": "3\x854"}]


def test_a_dataset_row_with_a_raw_line_separator_is_one_row(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"problem": "Add\u20282 and 3.", "answer": "5"}, {"problem": "Double 4.", "answer": "8"}]
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    assert load_dataset(path) == rows


def test_an_event_stream_line_is_one_line_to_httpx():
    event = {"choices": [{"delta": {"content": "a\u2028b\x85c\u2029d"}}]}
    body = f"data: {jsonl.line(event)}\n\ndata: {jsonl.line(event, compact=True)}\n\n".encode()
    lines = list(httpx.Response(200, content=body).iter_lines())
    assert [json.loads(row[6:]) for row in lines if row] == [event, event]


def _server_chunks(event: dict) -> bytes:
    import asyncio

    from treeserve.server.serving import _sse

    async def chunks():
        yield event

    async def body():
        return b"".join([piece.encode() if isinstance(piece, str) else piece
                         async for piece in _sse(chunks()).body_iterator])
    return asyncio.run(body())


def _writers():
    from treeserve.gateway.chat.routes import _sse as chat_event
    from treeserve.server.serving_search import _sse_line
    from treeserve.wire.translated_stream import sse

    return {"server chat/completions": _server_chunks, "server search": lambda e: _sse_line(e).encode(),
            "gateway web chat": chat_event, "responses/messages": lambda e: sse({"type": "delta", **e}).encode()}


def test_every_event_stream_writer_keeps_an_event_with_separators_on_one_line():
    event = {"choices": [{"delta": {"content": "a\u2028b\x85c\u2029d"}}]}
    for name, write in _writers().items():
        rows = [row for row in httpx.Response(200, content=write(event)).iter_lines() if row.startswith("data: ")]
        decoded = json.loads(rows[0][6:])
        decoded.pop("type", None)
        assert decoded == event, name
