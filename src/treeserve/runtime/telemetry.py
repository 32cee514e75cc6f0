"""Per-step KV cache telemetry per model, written as JSONL (one line per model per engine step)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TextIO

from treeserve.engine.llm_engine import LLMEngine


def cache_snapshot(engine: LLMEngine) -> dict:
    """Blocks in use / cached-but-free / free, and this model's cumulative prefix-cache counters."""
    stats = engine.stats(count_cached=True)
    return {"blocks_in_use": stats.kv_blocks_in_use, "blocks_cached": stats.kv_blocks_cached,
            "blocks_free": stats.kv_blocks_free, "blocks_total": stats.kv_blocks_total,
            "blocks_wanted": stats.kv_blocks_wanted, "prefix_queries": stats.prefix_queries,
            "prefix_hits": stats.prefix_hits, "evictions": stats.evictions, "thrash": stats.thrash,
            "preemptions": stats.num_preemptions}


class TelemetryTrace:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # line-buffered: each step's line is readable at once (a plot or `tail -f` while the runtime runs);
        # one write a line is nothing beside a step
        self._file: TextIO = self.path.open("w", encoding="utf-8", buffering=1)
        self._start = time.monotonic()

    def observe(self, engine: LLMEngine, outputs=None) -> None:
        """An engine loop step observer: one line for the engine that just stepped (none once closed:
        a step under way when its Runtime closed ends after the close)."""
        if self._file.closed:
            return
        record = {"t": round(time.monotonic() - self._start, 6), "model": engine.name, "step": engine.num_steps,
                  "num_tokens": engine.last_step_num_tokens, **cache_snapshot(engine)}
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
