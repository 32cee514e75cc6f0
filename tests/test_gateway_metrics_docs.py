"""docs/GATEWAY.md's Observability names every series the gateway's /metrics exports."""
from __future__ import annotations

import re
from pathlib import Path

from treeserve.gateway.metrics import GatewayMetrics

GATEWAY_DOC = Path(__file__).resolve().parents[1] / "docs" / "GATEWAY.md"


def _exported_names() -> set[str]:
    """Each family as a scrape shows it, less the prefix: counters with `_total`."""
    names = set()
    for family in GatewayMetrics().registry.collect():
        name = family.name.removeprefix("treeserve_gateway:")
        names.add(name + "_total" if family.type == "counter" else name)
    return names


def test_every_exported_gateway_metric_is_documented():
    documented = set(re.findall(r"`(?:treeserve_gateway:)?([a-z_]+)(?:\{[a-z_,]*\})?`", GATEWAY_DOC.read_text()))
    missing = sorted(_exported_names() - documented)
    assert not missing, f"exported by the gateway's /metrics but not named in docs/GATEWAY.md: {missing}"
