"""docs/METRICS.md names every series the server's /metrics exports, and says how long a scrape is."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METRICS_DOC = ROOT / "docs" / "METRICS.md"
METRICS_MODULE = ROOT / "src" / "treeserve" / "server" / "metrics.py"


@pytest.fixture(scope="module")
def default_pair_scrape() -> str:
    """The text of a scrape of `treeserve serve` with no model (the bundled pair), before any request."""
    from treeserve.model.registry import DEFAULT_PAIR
    from treeserve.server.launch import build_app

    app = build_app(dict(DEFAULT_PAIR), engine_thread=False, device="cpu",  # (a set KV budget: the default is
                    kv_cache_memory_bytes=16 << 20)  # a share of the memory free, which a busy CI may not have)
    return app.state.metrics.render().decode()


def _stated_line_counts() -> dict[str, int]:
    """Each "~N lines" the doc and the metrics module's docstring state for the default pair's scrape."""
    stated = {}
    for path in (METRICS_DOC, METRICS_MODULE):
        found = re.findall(r"~([\d,]+)\s+lines", path.read_text())
        assert found, f"{path.name} no longer states a scrape's line count: update this test"
        stated.update({f"{path.name} ~{n}": int(n.replace(",", "")) for n in found})
    return stated


def test_the_stated_line_count_of_a_default_scrape_is_current(default_pair_scrape):
    lines = default_pair_scrape.count("\n")
    stale = {where: n for where, n in _stated_line_counts().items() if abs(n - lines) > 0.1 * lines}
    assert not stale, f"a scrape of the default pair is {lines} lines; stated: {stale}"


def test_every_served_series_is_documented(default_pair_scrape):
    served = set()
    for line in default_pair_scrape.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2].removeprefix("treeserve:")
            if not name.endswith("_created"):  # prometheus_client's creation stamps, a family each
                served.add(name)
    documented = set(re.findall(r"`([a-z0-9_]+)(?:\{[a-z_]*\})?`", METRICS_DOC.read_text()))
    missing = sorted(name for name in served if name not in documented and name.removesuffix("_total") not in documented)
    assert not missing, f"served on /metrics but not named in docs/METRICS.md: {missing}"
