"""The synchronous engine: requests in, one scheduler step at a time, outputs out.

`LLMEngine` is a facade built in one step from a loaded model and the KV space it serves from;
its rooms: request intake (`request_intake`), the step pipeline (`step_pipeline`), output
processing (`deferred_outputs`, `output_processor`), kept KV (`kept_kv`). Only the engine loop
(`engine_loop.EngineLoop`) calls `step()`; what others read of its state is `stats()`."""
from __future__ import annotations

import logging
import weakref

from treeserve.config import EngineConfig
from treeserve.engine.close_guard import CloseGuard
from treeserve.engine.cuda_graphs import decode_graphs
from treeserve.engine.deferred_outputs import DeferredOutputs
from treeserve.engine.engine_stats import EngineStats, snapshot
from treeserve.engine.kept_kv import KeptSequences
from treeserve.engine.kv_cache_manager import KVCacheManager
from treeserve.engine.kv_space import KVSpace
from treeserve.engine.loaded_model import LoadedModel, load_model
from treeserve.engine.model_runner import ModelRunner
from treeserve.engine.output_processor import OutputProcessor
from treeserve.engine.request_groups import RequestGroups
from treeserve.engine.request_intake import RequestIntake
from treeserve.engine.scheduler import Scheduler
from treeserve.engine.spec_decode.drafters import make_drafter
from treeserve.engine.spec_decode.speculator import ENGINE_DEFAULT, Speculator
from treeserve.engine.step_builder import StepBuilder
from treeserve.engine.step_pipeline import StepPipeline
from treeserve.engine.structured_outputs import StructuredOutputs
from treeserve.engine.weakly import weakly
from treeserve.engine.workers_guard import WorkersGuard
from treeserve.errors import EngineClosedError, ParamError
from treeserve.outputs import AbortedRequest, RequestOutput
from treeserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, loaded: LoadedModel, kv_space: KVSpace, reclaim=None, scratch: bool = False,
                 owns: bool = False, owner: object = None):
        """`reclaim`: frees one kept sequence's blocks when the scheduler runs short (default: one of
        this engine's own; a `Runtime` passes one that tries every engine sharing the pool).
        `scratch`: a space for one measured prefill (runtime/memory.py), not for max_model_len.
        `owns`: the loaded model and the KV space are this engine's alone: `close` frees them too
        (else their owner does: a `Runtime`, or the caller that loaded the model).
        `owner`: what frees them, kept alive while this engine is (a Runtime's parts, runtime/parts.py).
        Nothing in the engine refers back to it (no reference cycle), so the last reference to go frees
        it, and what only it held, at once: no wait for the garbage collector."""
        if loaded.weights_released:
            raise EngineClosedError(f"{loaded.model_key!r} ({loaded.model_dir.name})",
                                    "the loaded model's weights were freed when its owner closed")
        self.loaded, self.owner = loaded, owner
        self.closed = False
        self._guard = kv_space.pool.guard  # a step and `close` never overlap (nor steps of engines sharing the pool)
        self._owned = (loaded, kv_space) if owns else None
        self._arena_bytes, self._graph_replays = kv_space.arena.nbytes, 0  # (statistics, read after close too)
        self.config, self.name, self.model_dir = loaded.config, loaded.name, loaded.model_dir
        self.model_config, self.tokenizer, self.model = loaded.model_config, loaded.tokenizer, loaded.model
        self.generation_defaults, self.device, self.dtype = loaded.generation_defaults, loaded.device, loaded.dtype
        self.max_model_len, self.attention_backend = loaded.max_model_len, loaded.attention_backend
        self.max_num_batched_tokens = loaded.max_num_batched_tokens
        self.shared_num_batched_tokens = loaded.shared_num_batched_tokens
        self.executor = loaded.executor
        async_scheduling = self._async_scheduling()  # (a setting it cannot honour fails before any work)
        block_size = loaded.block_size_in(kv_space, scratch)
        self.kv = KVCacheManager(block_size=block_size, pool=kv_space.pool, owner=self.name,
                                 window=self.model_config.kv_window)
        self.retained = KeptSequences(self.kv)
        self.scheduler = Scheduler(self.kv, self.config.max_num_seqs, self.max_num_batched_tokens,
                                   reclaim=reclaim or weakly(self.reclaim_one),
                                   shared_num_batched_tokens=self.shared_num_batched_tokens)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, loaded.eos_token_ids)
        self.steps = StepBuilder(self.kv, self.structured.vocab_size)
        self.runner = ModelRunner(self.model, block_size, kv_space.arena, self.dtype, self.device)
        self.runner.graphs = None if scratch else decode_graphs(loaded, self.runner.kv_caches, block_size)
        loaded.join_workers(kv_space, block_size)
        self._groups = RequestGroups()
        processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.outputs = DeferredOutputs(processor, self._groups, self._async_output())
        self.intake = RequestIntake(loaded, self.scheduler, self.kv, self._groups, self.retained, self.structured,
                                    processor.decode)
        self.guard = WorkersGuard(self.executor)
        self.speculator = Speculator(None if scratch else self.config.speculative_config, self.max_model_len,
                                     load_draft=lambda config: make_drafter(config, loaded, kv_space))
        if self.speculator.capture is not None:  # (an EAGLE head reads each step's rows: no replayed graphs)
            self.runner.capture, self.runner.graphs = self.speculator.capture, None
        self.pipeline = StepPipeline(self.scheduler, self.kv, self.steps, self.runner, self._groups, self.outputs,
                                     self.retained, self.guard, async_scheduling, self._step_sender(),
                                     self.speculator)
        # let go of, it gives its pool back the blocks it held (a shared pool serves on: a Runtime's other models)
        weakref.finalize(self, _give_back_when_free, self._guard, self.kv, self.speculator).atexit = False
        if not scratch:  # a Runtime's dry run: "engine ready" comes with the KV cache it serves with
            self._log_ready(kv_space.pool.num_blocks, block_size)

    @classmethod
    def from_config(cls, config: EngineConfig, name: str = "", executor=None) -> LLMEngine:
        """Loads the model and gives it a KV space of its own (sized by the config)."""
        loaded = load_model(config, name, executor)
        try:
            return cls(loaded, loaded.standalone_kv_space(), owns=True)
        except BaseException:
            loaded.close()  # the tensor-parallel workers it started, if any
            raise

    # ---- construction ---------------------------------------------------------------------
    def _async_output(self) -> bool:
        setting = self.config.async_output_processing
        return self.device.type == "cuda" if setting is None else setting

    def _async_scheduling(self) -> bool:
        setting = self.config.async_scheduling
        speculative = self.config.speculative_config is not None
        if setting is None:
            return self.device.type == "cuda" and self.executor is None and not speculative
        if setting and self.executor is not None:
            raise ParamError("async_scheduling", "is not supported with tensor parallelism")
        if setting and speculative:  # (a draft needs the step before it on the host)
            raise ParamError("async_scheduling", "is not supported with speculative decoding")
        return setting

    def _step_sender(self):
        if self.executor is None:
            return None
        executor, key = self.executor, self.loaded.model_key  # (not `self`: no cycle through the pipeline)
        return lambda step: executor.send_step(key, step)

    def _log_ready(self, num_blocks: int, block_size: int) -> None:
        logger.info("engine ready: %s on %s (%s, %s attention%s), %d KV blocks of %d tokens, steps of up to %d tokens "
                    "(%d for a lone request)", self.model_dir.name, self.device, self.dtype, self.attention_backend,
                    ", CUDA graphs" if self.uses_cuda_graphs else "", num_blocks, block_size,
                    self.shared_num_batched_tokens, self.max_num_batched_tokens)

    # ---- what it is -----------------------------------------------------------------------
    @property
    def groups(self):
        """Live request groups by request id."""
        return self._groups.by_id

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.runner.graphs is not None

    @property
    def num_steps(self) -> int:
        return self.pipeline.num_steps

    @property
    def num_tokens_computed(self) -> int:
        return self.pipeline.num_tokens_computed

    @property
    def last_step_num_tokens(self) -> int:
        return self.pipeline.last_step_num_tokens

    def kv_bytes_per_token(self) -> int:
        return self.loaded.kv_bytes_per_token()

    def stats(self, count_cached: bool = False) -> EngineStats:
        """A snapshot of queues, KV blocks and counters (`count_cached`: also walk the pool for this
        model's cached free blocks)."""
        return snapshot(self.name, self.pipeline, self.scheduler, self.kv, self.retained, self._arena_bytes,
                        count_cached, self._num_graph_replays())

    def _num_graph_replays(self) -> int:
        graphs = self.runner.graphs
        return graphs.num_replays if graphs is not None else self._graph_replays

    # ---- requests -------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        self.intake.validate_prompt(prompt_token_ids)

    def check_token_ids(self, params: SamplingParams) -> None:
        """ParamError unless every token id the parameters name (logit_bias, allowed_token_ids, bad_words'
        tokens) is in the vocabulary: what a server checks before it answers."""
        self.intake.check_token_ids(params)

    def truncated_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as the request will run it: its last `params.truncate_prompt_tokens` tokens."""
        return self.intake.truncated_prompt(prompt_token_ids, params)

    def compile_grammar(self, structured: StructuredOutputsParams):
        """Compiles (once; then cached) what a request's output must match; a bad one is a ParamError."""
        return self.structured.compile(structured)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, cache_salt: str | None = None,
                    logits_positions: list[int] | None = None, readout_token_ids: list[int] | None = None,
                    keep_kv: bool = False, parent_id: str | None = None, priority: int = 0,
                    final_only: bool = False, draft_group: str | None = None,
                    speculative_config=ENGINE_DEFAULT) -> None:
        """Queues a request; a lower `priority` is admitted first (FCFS within one priority).
        `final_only`: no RequestOutput until it finishes (offline callers; saves the host a
        snapshot of every sequence at every step).

        With `logits_positions` it is prefill-only and returns those positions' logits (only the
        `readout_token_ids` columns, if given). `speculative_config`: the engine's (by default), the
        request's own (vLLM's dict) or None (no speculation); `draft_group`: with `suffix`
        speculation, its drafts come from every sequence of this group too (a search problem's).
        `keep_kv` keeps its KV blocks after it finishes,
        under its request id, until `release_kv`; `parent_id` names such a kept sequence whose
        tokens this prompt extends, so that only the new tokens are computed.
        """
        with self._guard:
            self.require_open()
            speculative = self.speculator.config_for(speculative_config)
            self.intake.add(request_id, prompt_token_ids, params, prompt, cache_salt, logits_positions,
                            readout_token_ids, keep_kv, parent_id, priority, final_only, draft_group, speculative)

    def abort_request(self, request_id: str) -> AbortedRequest | None:
        """Aborts a live request (frees its blocks); what it had done, None if it was not live."""
        with self._guard:
            return self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> AbortedRequest | None:
        group = self._groups.pop(request_id)
        if group is None:
            return None
        done = AbortedRequest(request_id, tuple((c.num_output_tokens, c.finish_reason) for c in group.children),
                              group.delta)
        for request in group.members():
            self.scheduler.finish(request, "abort")
        self.pipeline.drop_unwanted_in_flight()
        self.speculator.retain(self.scheduler.running)
        return done

    def has_unfinished_requests(self) -> bool:
        return self.pipeline.busy

    def release_kv(self, request_id: str) -> None:
        """Frees the blocks kept for a finished `keep_kv` request (full blocks stay prefix-cached)."""
        with self._guard:
            self.retained.release(request_id)

    def release_kv_first(self, request_id: str) -> None:
        """Kept blocks that this request holds are released before any other kept sequence's
        when the pool runs short (the caller expects no request to extend them soon)."""
        self.retained.release_first(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix of the pool it draws from (vLLM's `reset_prefix_cache`; in a
        shared arena, every model's). False, and nothing changed, while any block is in use."""
        with self._guard:
            return self.kv.pool.reset_prefix_cache()

    def reclaim_one(self) -> bool:
        """Frees blocks the engine can do without: its draft model's KV (speculation) first, else
        its least recently used kept sequence; False when it holds neither."""
        return self.speculator.release_kv() or self.retained.release_oldest()

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step (`StepPipeline.run_step`). With async output processing, the text of the
        previous step's tokens (and its groups' outputs) is made while the device runs this step,
        and returned with this step's outputs that need no text; a request with stop strings has
        its text made at once (a stop string ends it before the next schedule)."""
        with self._guard:
            self.require_open()
            return self.pipeline.run_step()

    @property
    def is_stalled(self) -> bool:
        """Its last step scheduled nothing because other models sharing its KV pool hold the blocks
        its waiting requests need (they wait for those requests to end)."""
        return self.pipeline.stalled

    def check_health(self) -> None:
        """Raises the error that stopped the engine, or a tensor-parallel worker's death."""
        self.guard.check()

    # ---- closing --------------------------------------------------------------------------
    def require_open(self) -> None:
        """EngineClosedError, naming the engine and its model, once `close` has run."""
        if self.closed:
            raise EngineClosedError(f"{self.name!r} ({self.model_dir.name})" if self.name else repr(self.model_dir.name))

    def close(self) -> None:
        """Frees what the engine holds now, not when the last reference to it goes: its CUDA graphs,
        draft models, KV views and model, and, where they are its own (`owns`: `LLM`,
        `from_config`), the weights and the KV arena; stops the tensor-parallel workers it started.
        A step under way ends first (called from within it, a finalizer run by the garbage
        collector on the stepping thread, the close runs as it returns: engine/close_guard.py).
        Then every call that would run the model (`add_request`, `step`) raises EngineClosedError:
        requests still held fail at the loop's next step, as vLLM's fail once its engine core is
        shut down. `stats()` and the counters stay readable. Closing again does nothing."""
        self._guard.run_or_defer(self._close_now)

    def after_close(self, fn) -> None:
        """Runs `fn` once this engine's `close` has run (now, unless a step under way on this
        thread defers it): for the owner of memory the engine ran on."""
        self._guard.run_or_defer(fn)

    def _close_now(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._graph_replays = self._num_graph_replays()
        if self._owned is not None:  # (a model given loaded, `Runtime({"gen": load_model(...)})`, keeps its workers)
            self.loaded.close()  # the tensor-parallel workers it started, if any
        self.pipeline.in_flight = None
        self.speculator.close()
        self.runner.release()
        self.model = None
        if self._owned is not None:
            loaded, space = self._owned
            loaded.release_weights()
            space.release()
            self._owned = None


def _give_back_when_free(guard: CloseGuard, kv: KVCacheManager, speculator: Speculator) -> None:
    """An engine let go of: the blocks its requests, kept sequences and drafts held go back to the pool,
    now if nothing changes the pool, else as the step under way ends (the last reference may go on any
    thread, mid-step: another engine on the pool stepping, the garbage collector run inside it)."""
    guard.run_when_free(lambda: _give_back(kv, speculator))


def _give_back(kv: KVCacheManager, speculator: Speculator) -> None:
    speculator.release_kv()
    kv.free_all()
