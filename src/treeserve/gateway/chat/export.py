"""A user's conversations as a spreadsheet (openpyxl; one row per message) or as JSON.

Cells are written as text, never as formulas: a message that starts with '=' (or '+', '-', '@')
would otherwise run as a formula in the reader's spreadsheet program."""
from __future__ import annotations

import io
import json

from openpyxl import Workbook
from openpyxl.cell.cell import ILLEGAL_CHARACTERS_RE

COLUMNS = ("conversation_id", "conversation", "time", "role", "content", "model", "mode", "settings",
           "prompt_tokens", "completion_tokens")
CELL_LIMIT = 32767  # characters an Excel cell holds
CUT = " [cut: the JSON export has all of it]"
WIDTHS = {"conversation_id": 34, "conversation": 30, "time": 27, "content": 80, "settings": 50}


def rows(conversations: list[dict]) -> list[tuple]:
    return [(c["id"], c["title"], m["created_at"], m["role"], m["content"], m["model"] or "", m["mode"],
             json.dumps(m["settings"], sort_keys=True), m["prompt_tokens"], m["completion_tokens"])
            for c in conversations for m in c["messages"]]


def to_xlsx(conversations: list[dict]) -> bytes:
    workbook = Workbook()
    sheet = workbook.active
    sheet.title = "messages"
    sheet.append(COLUMNS)
    for row in rows(conversations):
        sheet.append([_text(v) if isinstance(v, str) else v for v in row])
        for cell in sheet[sheet.max_row]:
            if isinstance(cell.value, str):
                cell.data_type = "s"  # a string, even when it looks like a formula
    for index, name in enumerate(COLUMNS):
        sheet.column_dimensions[chr(ord("A") + index)].width = WIDTHS.get(name, 14)
    sheet.freeze_panes = "A2"
    buffer = io.BytesIO()
    workbook.save(buffer)
    return buffer.getvalue()


def to_json(user_id: str, conversations: list[dict]) -> bytes:
    return json.dumps({"user_id": user_id, "conversations": conversations}, ensure_ascii=False, indent=2).encode()


def _text(value: str) -> str:
    value = ILLEGAL_CHARACTERS_RE.sub("\ufffd", value)  # control characters XLSX cannot hold
    if len(value) > CELL_LIMIT:  # (the JSON export has it whole)
        value = value[:CELL_LIMIT - len(CUT)] + CUT
    return value
