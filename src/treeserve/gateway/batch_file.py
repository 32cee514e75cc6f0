"""A batch's input file, validated as OpenAI's Batch API does: every request line is read, and the
file's problems come back as OpenAI's batch errors (code, message, param, line), all of them, not
only the first. A file with any error makes a batch that ends `failed` with them (gateway/batches.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/search")
MAX_LINES = 50_000  # OpenAI's
MAX_CUSTOM_ID = 256  # characters (its column's width)
MAX_ERRORS = 100  # listed of a file's errors (the first, in line order)


@dataclass
class BatchFile:
    lines: list[tuple[str, str, dict]] = field(default_factory=list)  # (custom_id, url, body)
    errors: list[dict] = field(default_factory=list)  # OpenAI's batch errors


def error(code: str, message: str, param: str | None = None, line: int | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def read(content: bytes, endpoint: str) -> BatchFile:
    """Each request line's (custom_id, url, body), and every error. A line's url is the batch's
    endpoint or, treeserve's extension, another of ENDPOINTS (one batch may mix chats, completions,
    responses and searches)."""
    found, seen = BatchFile(), set()
    content = content.removeprefix(b"\xef\xbb\xbf")  # (a UTF-8 byte order mark, as Windows editors write)
    for number, raw in enumerate(content.split(b"\n"), start=1):  # ("\n" alone: see treeserve/jsonl.py)
        if not raw.strip():
            continue
        line, problem = _request(raw, number, endpoint, seen)
        if problem is not None:
            found.errors.append(problem)
        elif not found.errors:  # (once the file has failed, its good lines are not kept)
            found.lines.append(line)
    if not found.errors and not found.lines:
        found.errors.append(error("empty_file", "the file has no request lines", "input_file_id"))
    elif len(found.lines) > MAX_LINES:
        found.errors.append(error("too_many_tasks", f"{len(found.lines)} request lines; a batch takes at most "
                                                     f"{MAX_LINES}", "input_file_id"))
    del found.errors[MAX_ERRORS:]
    if found.errors:
        found.lines = []
    return found


def _request(raw: bytes, number: int, endpoint: str, seen: set[str]) -> tuple[tuple | None, dict | None]:
    """One line's (custom_id, url, body), or its error."""
    try:
        item = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return None, error("invalid_json_line", f"line {number} is not UTF-8 ({exc.reason})", line=number)
    except ValueError as exc:
        return None, error("invalid_json_line", f"line {number} is not JSON ({exc})", line=number)
    except RecursionError:  # (json's C parser recurses once per level of nesting)
        return None, error("invalid_json_line", f"line {number} is nested too deeply", line=number)
    if not isinstance(item, dict):
        return None, error("invalid_json_line", f"line {number} is not a JSON object", line=number)
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, error("missing_required_parameter", f"line {number}: needs a custom_id (a string)",
                            "custom_id", number)
    if len(custom_id) > MAX_CUSTOM_ID or "\x00" in custom_id:
        return None, error("invalid_custom_id", f"line {number}: custom_id must be at most {MAX_CUSTOM_ID} "
                                                 "characters, without NUL", "custom_id", number)
    if custom_id in seen:
        return None, error("duplicate_custom_id", f"line {number}: custom_id {custom_id!r} is not unique",
                            "custom_id", number)
    seen.add(custom_id)
    url = item.get("url", endpoint)
    if item.get("method", "POST") != "POST":
        return None, error("invalid_method", f"line {number}: method must be POST, got {item.get('method')!r}",
                            "method", number)
    if url not in ENDPOINTS:
        return None, error("url_mismatch", f"line {number}: url must be one of {', '.join(ENDPOINTS)}, "
                                            f"got {url!r}", "url", number)
    body = item.get("body")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return None, error("missing_required_parameter", f"line {number}: body must be an object naming its model",
                            "body", number)
    if body.get("stream"):
        return None, error("invalid_request", f"line {number}: a batch's requests cannot stream", "body.stream",
                            number)
    return (custom_id, url, body), None
