"""The chat page's own files: every script and style sheet index.html loads is one the gateway serves
(its allow-list is read from the page) and one a wheel carries (pyproject's package data), so that a
script split off another can never be left out of either."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import treeserve
from treeserve.gateway.chat.routes import ASSETS, STATIC

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_the_page_loads_is_served_and_packaged():
    page = (STATIC / "index.html").read_text(encoding="utf-8")
    loaded = re.findall(r'(?:src|href)="/chat/static/([^"]+)"', page)
    assert {"markdown.js", "chat.js", "chat.css"} <= set(loaded) and len(loaded) == len(set(loaded))
    assert set(ASSETS) == set(loaded)
    package = Path(treeserve.__file__).parent
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["treeserve"]
    carried = {path for pattern in globs for path in package.glob(pattern)}
    for name in loaded:
        assert (STATIC / name).is_file(), name
        assert STATIC / name in carried, f"{name}: not in pyproject's package data (a wheel would lack it)"
        assert ASSETS[name] == ("text/css" if name.endswith(".css") else "text/javascript")


def test_chat_scripts_share_one_scope_without_clashing_names():
    """The page's scripts are classic ones sharing the page's global scope: a top-level name given twice
    would throw (const) or silently replace the first (function)."""
    declared: dict[str, str] = {}
    for name in (n for n in ASSETS if n.endswith(".js")):
        source = (STATIC / name).read_text(encoding="utf-8")
        for top in re.findall(r"^(?:async )?function (\w+)|^(?:const|let|var) ([\w$]+)", source, re.M):
            top = top[0] or top[1]
            assert top not in declared, f"{top} is declared by both {declared.get(top)} and {name}"
            declared[top] = name
    assert {"renderMarkdown", "renderMessage", "streamAnswer", "readSettings", "api", "$"} <= set(declared)
