"""`EngineStats`: a plain snapshot of one engine's queues, KV blocks and counters, which is all that
metrics, telemetry, the scorer and benchmarks read of an engine's insides."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from treeserve.engine.kept_kv import KeptSequences
from treeserve.engine.kv_cache_manager import KVCacheManager
from treeserve.engine.scheduler import Scheduler


@dataclass(frozen=True)
class EngineStats:
    model: str
    num_steps: int                 # steps that ran the model
    num_tokens_computed: int       # tokens that went through the model, all steps
    last_step_num_tokens: int
    num_steps_left_running: int    # steps whose successor was launched before their results were applied
    num_running: int
    num_waiting: int
    num_preemptions: int
    block_size: int                # tokens per KV block of this model
    kv_blocks_total: int           # the pool's blocks (shared with other models in a shared arena)
    kv_blocks_in_use: int          # held by this model's requests
    kv_blocks_free: int            # the pool's free blocks (cached or empty)
    kv_blocks_wanted: int          # this model's cached blocks that waiting work wants kept
    kv_pool_usage: float           # the pool's share of blocks in use, all models
    thrash_window_size: int
    prefix_queries: int            # prompt tokens looked up in the prefix cache
    prefix_hits: int
    evictions: int
    thrash: int
    kept_sequences: int            # finished sequences whose KV is kept for extensions
    kept_blocks: int
    kv_arena_bytes: int            # the KV space's bytes (shared with other models in a shared arena)
    kv_blocks_cached: int | None = None  # this model's cached free blocks: counted only when asked (a walk)
    num_graph_replays: int = 0     # decode steps run as a captured CUDA graph (the rest ran eagerly)
    # speculative decoding (vLLM's counters): drafts verified (one per request and step), their
    # tokens, the tokens accepted, and accepted by draft position (1st, 2nd, ...)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # `thrash` by the model whose allocation evicted the block: this model's own, or (in a shared
    # arena) another's
    thrash_by_evictor: dict[str, int] = field(default_factory=dict)
    # vLLM's prompt_tokens and generation_tokens, counted as the work is done: each request's prompt once
    # its prefill is done, each generated token as it is sampled (a request's caller streaming or not)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        """This model's share of the pool's blocks."""
        return self.kv_blocks_in_use / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def snapshot(model: str, pipeline, scheduler: Scheduler, kv: KVCacheManager, retained: KeptSequences,
             arena_bytes: int, count_cached: bool = False, graph_replays: int = 0) -> EngineStats:
    pool, prefix = kv.pool, kv.stats
    return EngineStats(
        model, pipeline.num_steps, pipeline.num_tokens_computed, pipeline.last_step_num_tokens,
        pipeline.num_steps_left_running,
        len(scheduler.running), len(scheduler.waiting), scheduler.num_preemptions, kv.block_size,
        pool.num_blocks, kv.num_blocks_in_use(), pool.num_free, pool.num_wanted_by(kv.owner), pool.usage(),
        pool.thrash_window_size, prefix.queries, prefix.hits, prefix.evictions, prefix.thrash,
        len(retained), retained.num_blocks(), arena_bytes, _cached_blocks(kv) if count_cached else None,
        graph_replays, *_spec_counts(pipeline.speculator), thrash_by_evictor=dict(prefix.thrash_by_evictor),
        num_prompt_tokens=pipeline.num_prompt_tokens, num_generation_tokens=pipeline.num_generation_tokens)


def _spec_counts(speculator) -> tuple:
    if speculator is None or not speculator.active:
        return 0, 0, 0, ()
    return (speculator.num_drafts, speculator.num_draft_tokens, speculator.num_accepted_tokens,
            tuple(speculator.accepted_per_position))


def _cached_blocks(kv: KVCacheManager) -> int:
    return sum(1 for b in kv.pool.blocks if b.owner == kv.owner and not b.ref_count and b.block_hash is not None)
