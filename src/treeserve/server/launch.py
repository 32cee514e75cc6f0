"""`treeserve serve`: build the engine, the async loop, the app, and run uvicorn."""
from __future__ import annotations

import logging
import os

from treeserve.config import EngineConfig
from treeserve.engine.async_engine import AsyncLLMEngine
from treeserve.engine.llm_engine import LLMEngine
from treeserve.server.app import create_app
from treeserve.server.metrics import EngineMetrics


def build_app(model: str, served_model_name: str | None = None, api_keys: list[str] | None = None,
              max_queue: int | None = None, **engine_options):
    engine = LLMEngine(EngineConfig(model=model, **engine_options))
    name = served_model_name or str(model)
    metrics = EngineMetrics(name)
    async_engine = AsyncLLMEngine(engine, max_queue=max_queue, on_step=metrics.on_step, on_abort=metrics.on_abort)
    return create_app(async_engine, name, api_keys=api_keys, metrics=metrics)


def serve(args) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = list(args.api_key or [])
    if not keys and os.environ.get("TREESERVE_API_KEY"):
        keys = [os.environ["TREESERVE_API_KEY"]]
    app = build_app(args.model_path or args.model, served_model_name=args.served_model_name, api_keys=keys,
                    max_queue=args.max_queue, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    kv_cache_memory_bytes=args.kv_cache_memory_bytes, block_size=args.block_size,
                    enable_prefix_caching=not args.no_prefix_caching)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        app.state.engine.shutdown()
    return 0
