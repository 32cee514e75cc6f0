"""The synchronous engine: requests in, one scheduler step at a time, outputs out."""
from __future__ import annotations

import contextlib
import logging

import torch

from treeserve.errors import ParamError
from treeserve.config import EngineConfig
from treeserve.engine.detokenizer import IncrementalDetokenizer
from treeserve.engine.kept_kv import KeptSequences
from treeserve.engine.cuda_graphs import DecodeGraphs
from treeserve.engine.kv_cache_manager import KVCacheManager
from treeserve.engine.memory import kv_budget_bytes
from treeserve.engine.kv_arena import kv_bytes_per_token
from treeserve.engine.kv_space import KVSpace
from treeserve.engine.model_runner import ModelRunner
from treeserve.engine.output_processor import OutputProcessor
from treeserve.engine.request import Request, RequestGroup
from treeserve.engine.scheduler import Scheduler
from treeserve.engine.step_builder import StepBuilder
from treeserve.engine.structured_outputs import StructuredOutputs
from treeserve.engine.token_budget import lone_request_budget, serving_token_budget
from treeserve.model.backends import make_backend, resolve_backend_name
from treeserve.engine.tp_start import start_executor
from treeserve.engine.tp_worker import ModelSpec, prepare_kernels
from treeserve.model.hf_config import load_model_config
from treeserve.model.parallel import ShardPlan, TensorParallel
from treeserve.model.loader import build_model, load_generation_defaults, load_tokenizer
from treeserve.model.registry import resolve_model_path
from treeserve.outputs import RequestOutput
from treeserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Request lifecycle and stepping for one model. Output processing (detokenizing, stop checks,
    outputs) is `OutputProcessor`'s; kept KV is `KeptSequences`'. Only the engine loop
    (`engine_loop.EngineLoop`) calls `step()`."""

    def __init__(self, config: EngineConfig, name: str = "", defer_kv: bool = False, executor=None):
        """`name` namespaces this model's prefix-cache hashes (several models may share one pool);
        `defer_kv` leaves KV memory to be attached later with `attach_kv` (by a `Runtime`);
        `executor`: the tensor-parallel workers this engine's model joins (a `Runtime`'s, shared by
        its models); with tensor_parallel_size > 1 and none given, the engine starts its own."""
        self.config = config
        self.name = name
        model_dir = resolve_model_path(config.model)
        self.model_config = load_model_config(model_dir)
        self.tokenizer = load_tokenizer(resolve_model_path(config.tokenizer) if config.tokenizer else model_dir)
        self.generation_defaults = load_generation_defaults(model_dir, self.model_config)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device, self.model_config.torch_dtype)
        self.max_model_len = self._max_model_len()
        # the most tokens one step holds, and the budget of a step with more than one request in it
        self.shared_num_batched_tokens = config.max_num_batched_tokens or serving_token_budget(self.model_config,
                                                                                                self.device)
        self.max_num_batched_tokens = config.max_num_batched_tokens or lone_request_budget(
            self.shared_num_batched_tokens)
        torch.manual_seed(config.seed)
        self.attention_backend = resolve_backend_name(config.attention_backend, self.device, self.dtype)
        self.executor, self._owns_executor, self.failed = executor, False, None
        try:
            self._build(model_dir, defer_kv)
        except BaseException:
            self.close()  # the tensor-parallel workers it started, if any
            raise

    def _build(self, model_dir, defer_kv: bool) -> None:
        config = self.config
        self.model = build_model(model_dir, self.model_config, self.dtype, self.device, self.max_model_len,
                                 config.load_format, config.seed, self._tensor_parallel())
        self.model.backend = make_backend(self.attention_backend, self.model.kv_config, self.dtype, self.device)
        self.groups: dict[str, RequestGroup] = {}
        self.last_step_num_tokens = 0
        self.num_steps = 0
        self.num_tokens_computed = 0  # every token that went through the model, all steps
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.retained = KeptSequences()
        self._group_of: dict[str, RequestGroup] = {}
        async_output = config.async_output_processing
        self.async_output = self.device.type == "cuda" if async_output is None else async_output
        self._deferred_text: list[Request] = []  # sampled last step, text not made yet
        self._deferred_groups: dict[str, RequestGroup] = {}
        scheduling = config.async_scheduling
        self.async_scheduling = (self.device.type == "cuda" and self.executor is None) if scheduling is None \
            else scheduling
        if self.async_scheduling and self.executor is not None:
            raise ParamError("async_scheduling", "is not supported with tensor parallelism")
        self._in_flight = None  # (scheduler output, launched step) of a step whose results are not applied yet
        self.num_steps_left_running = 0  # steps whose successor was launched before their results were applied
        self.model_dir = model_dir
        if not defer_kv:
            self.attach_kv(self.standalone_kv_space())

    def _tensor_parallel(self) -> TensorParallel:
        """This process's rank (0) of the model's ranks; starts the workers where none are given."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return TensorParallel()
        config = self.model_config
        ShardPlan.check(TensorParallel(0, size), config.num_heads, config.num_kv_heads, config.head_dim,
                        config.intermediate_size, config.vocab_size)  # before any process starts
        if self.executor is None:
            self.executor, self._owns_executor = start_executor(self.config, self.device), True
        return self.executor.tp

    @property
    def model_key(self) -> str:
        return self.name or "model"

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes on this rank (its heads)."""
        return kv_bytes_per_token(self.model.kv_config, self.dtype)

    def standalone_kv_space(self) -> KVSpace:
        page_bytes = self.config.block_size * self.kv_bytes_per_token()
        budget = kv_budget_bytes(self.config, self.device)
        return KVSpace.create(budget, page_bytes, self.device, self.config.enable_prefix_caching)

    def _tokens_held_at_most(self, block_size: int) -> int:
        """KV one sequence may hold at once: all of max_model_len, or with a window on every layer
        the window, one step's chunk and the two blocks they may straddle."""
        window = self.model_config.kv_window
        if window is None:
            return self.max_model_len
        return min(self.max_model_len, window + self.max_num_batched_tokens + 2 * block_size)

    def attach_kv(self, space: KVSpace, reclaim=None, scratch: bool = False) -> None:
        """`reclaim`: frees one kept sequence's blocks when the scheduler runs short (default: one of
        this engine's own; a `Runtime` passes one that tries every engine sharing the pool).
        `scratch`: a space for one measured prefill (runtime/memory.py), not for max_model_len."""
        block_size = space.arena.block_size_for(self.model.kv_config, self.dtype)
        num_blocks = space.pool.num_blocks
        if not scratch and num_blocks * block_size < self._tokens_held_at_most(block_size):
            raise ParamError(
                "kv_cache_memory_bytes", f"room for {num_blocks} blocks ({num_blocks * block_size} tokens), "
                f"fewer than one sequence of max_model_len={self.max_model_len} holds; raise the KV budget or "
                "lower max_model_len"
            )
        self.kv = KVCacheManager(block_size=block_size, pool=space.pool, owner=self.name,
                                 window=self.model_config.kv_window)
        self.retained.kv = self.kv
        self.scheduler = Scheduler(self.kv, self.config.max_num_seqs, self.max_num_batched_tokens,
                                   reclaim=reclaim or self._reclaim_one,
                                   shared_num_batched_tokens=self.shared_num_batched_tokens)
        self.steps = StepBuilder(self.kv, self.structured.vocab_size)
        self.runner = ModelRunner(self.model, block_size, space.arena, self.dtype, self.device)
        self.runner.graphs = None if scratch else self._decode_graphs(block_size)  # a dry run decodes nothing
        if self.executor is not None:
            prepare_kernels(self.device)  # rank 0 too, before the workers wait on it in a collective
            self.executor.add_model(self.model_key, ModelSpec(
                str(self.model_dir), self.dtype, self.max_model_len, self.config.load_format, self.config.seed,
                self.attention_backend, block_size, space.arena.num_pages, space.arena.page_bytes, space.arena.serial))
        if scratch:  # a Runtime's dry run: "engine ready" comes with the KV cache it serves with
            return
        logger.info("engine ready: %s on %s (%s, %s attention%s), %d KV blocks of %d tokens, steps of up to %d tokens "
                    "(%d for a lone request)", self.model_dir.name, self.device, self.dtype, self.attention_backend,
                    ", CUDA graphs" if self.runner.graphs else "", num_blocks, block_size,
                    self.shared_num_batched_tokens, self.max_num_batched_tokens)

    def _decode_graphs(self, block_size: int) -> DecodeGraphs | None:
        """Decode steps' CUDA graphs, captured now: with Triton attention on CUDA, unless enforce_eager."""
        if self.attention_backend != "triton" or self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if self.executor is not None:
            logger.info("tensor parallel: decode steps run eagerly (workers capture no CUDA graphs yet)")
            return None
        if self.model_config.moe is not None:  # its experts' grouping reads the routing on the host
            logger.info("mixture of experts: decode steps run eagerly (no CUDA graphs)")
            return None
        graphs = DecodeGraphs(self.model, self.runner.kv_caches, self.config.max_num_seqs,
                              -(-self.max_model_len // block_size), self.device)
        graphs.capture()
        return graphs

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is not None and wanted > limit:
            raise ParamError("max_model_len", f"{wanted} exceeds the model's max_position_embeddings ({limit})")
        return wanted or limit

    # ---- requests -------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ParamError("prompt", "must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ParamError(
                "prompt", f"{len(prompt_token_ids)} tokens is too long for the maximum model length "
                f"{self.max_model_len} (at least one token must be generated)"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError("prompt", f"token id {bad!r} is outside the vocabulary [0, {vocab})")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, cache_salt: str | None = None,
                    logits_positions: list[int] | None = None, readout_token_ids: list[int] | None = None,
                    keep_kv: bool = False, parent_id: str | None = None, priority: int = 0,
                    final_only: bool = False) -> None:
        """Queues a request; a lower `priority` is admitted first (FCFS within one priority).
        `final_only`: no RequestOutput until it finishes (offline callers; saves the host a
        snapshot of every sequence at every step).

        With `logits_positions` it is prefill-only and returns those positions' logits (only the
        `readout_token_ids` columns, if given). `keep_kv` keeps its KV blocks after it finishes,
        under its request id, until `release_kv`; `parent_id` names such a kept sequence whose
        tokens this prompt extends, so that only the new tokens are computed.
        """
        self.validate_prompt(prompt_token_ids)
        if request_id in self.groups or request_id in self.retained:
            raise ParamError("request_id", f"{request_id!r} is already in use")
        self._check_params(params, prefill_only=logits_positions is not None)
        if logits_positions is not None:
            self._add_prefill_only(request_id, prompt_token_ids, params, prompt, cache_salt, logits_positions,
                                   readout_token_ids, keep_kv, parent_id, priority)
            return
        children = [self._make_request(f"{request_id}#{i}", prompt_token_ids, self._child_params(params, i), cache_salt,
                                       priority) for i in range(params.n)]
        group = RequestGroup(request_id, prompt, list(prompt_token_ids), children, final_only=final_only)
        self._register(group)
        # (LongRoPE picks its factors by prompt length: the shorter shared prefill could pick others)
        if params.n > 1 and len(prompt_token_ids) > 1 and not self.model.rotary.long_offset:
            shared = Request(f"{request_id}#prefill", list(prompt_token_ids[:-1]), params, cache_salt=cache_salt,
                             cache_namespace=self.name, prefill_only=True, priority=priority)
            group.shared_prefill = shared
            self._group_of[shared.request_id] = group
            self._want_prompt_logprobs(group, shared)
            self.scheduler.add(shared)
        else:
            self._want_prompt_logprobs(group, children[0])
            for child in children:
                self.scheduler.add(child)

    def _cache_namespace(self, num_prompt_tokens: int) -> str:
        """Prefix-cache hashes are per model, and with LongRoPE per regime: a prompt past the original
        length computes every position with the long factors, so its blocks never stand in for a
        shorter prompt's (or the other way round)."""
        rotary = self.model.rotary
        return f"{self.name}:longrope" if rotary.long_offset and num_prompt_tokens > rotary.long_from else self.name

    @staticmethod
    def _want_prompt_logprobs(group: RequestGroup, computing: Request) -> None:
        """The request that computes the group's prompt also computes its prompt logprobs, if asked."""
        if computing.sampling_params.prompt_logprobs is None:
            return
        computing.prompt_logprob_ids = list(group.prompt_token_ids)
        computing.prompt_logprobs = group.prompt_logprobs = [None] * len(group.prompt_token_ids)

    def _check_params(self, params: SamplingParams, prefill_only: bool) -> None:
        """What the parameters ask of this model, checked before anything is queued; a grammar that
        cannot compile fails here (compiled once, then cached)."""
        if not prefill_only and self.model_config.head != "lm":
            raise ParamError("model", f"{self.model_dir.name} is a process reward model "
                             f"({self.model_config.architecture}): it scores steps (/v1/rewards, a search's "
                             "verifier) and generates nothing")
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ParamError("logit_bias", f"token id {max(params.logit_bias)} is outside the vocabulary [0, {vocab})")
        if prefill_only and params.structured_outputs is not None:
            raise ParamError("structured_outputs", "not available with logits_positions (nothing is sampled)")
        if prefill_only and params.prompt_logprobs is not None:
            raise ParamError("prompt_logprobs", "not available with logits_positions (they return the logits)")
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)

    def _add_prefill_only(self, request_id, prompt_token_ids, params, prompt, cache_salt, positions,
                          readout_token_ids, keep_kv, parent_id, priority) -> None:
        bad = [p for p in positions if not isinstance(p, int) or not 0 <= p < len(prompt_token_ids)]
        if bad:
            raise ParamError("logits_positions", f"{bad[:3]} outside the prompt (length {len(prompt_token_ids)})")
        width = self.model_config.output_width  # the vocabulary, or a reward head's outputs
        if readout_token_ids is not None and not all(0 <= t < width for t in readout_token_ids):
            raise ParamError("readout_token_ids", f"ids must be in [0, {width})")
        parent = self.retained.parent(parent_id, prompt_token_ids)
        if parent is not None and parent.cache_namespace != self._cache_namespace(len(prompt_token_ids)):
            parent = None  # LongRoPE: the kept keys were rotated with the other factors; computed afresh
        request = Request(f"{request_id}#0", list(prompt_token_ids), params, cache_salt=cache_salt,
                          cache_namespace=self._cache_namespace(len(prompt_token_ids)), prefill_only=True,
                          logits_positions=sorted(set(positions)),
                          readout_token_ids=readout_token_ids, keep_kv=keep_kv, priority=priority)
        self._register(RequestGroup(request_id, prompt, list(prompt_token_ids), [request]))
        if parent is not None:
            self.kv.fork(parent, request)
            request.num_cached_tokens = request.num_computed_tokens
        self.scheduler.add(request)

    def release_kv(self, request_id: str) -> None:
        """Frees the blocks kept for a finished `keep_kv` request (full blocks stay prefix-cached)."""
        self.retained.release(request_id)

    def release_kv_first(self, request_id: str) -> None:
        """Kept blocks that this request holds are released before any other kept sequence's
        when the pool runs short (the caller expects no request to extend them soon)."""
        self.retained.release_first(request_id)

    def _reclaim_one(self) -> bool:
        return self.retained.release_oldest()

    def _register(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for child in group.children:
            self._group_of[child.request_id] = group

    @staticmethod
    def _child_params(params: SamplingParams, index: int) -> SamplingParams:
        if params.n == 1:
            return params
        seed = None if params.seed is None else params.seed + index
        return params.clone(n=1, seed=seed)

    def _make_request(self, request_id, prompt_token_ids, params, cache_salt, priority=0) -> Request:
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
                          max_tokens=max_tokens, cache_salt=cache_salt,
                          cache_namespace=self._cache_namespace(len(prompt_token_ids)), priority=priority)
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                     self.outputs.decode)
        if params.structured_outputs is not None:
            request.matcher = self.structured.matcher(params.structured_outputs)
        return request

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = self.generation_defaults.eos_token_ids
        if not ids and self.tokenizer.eos_token_id is not None:
            ids = (self.tokenizer.eos_token_id,)
        return ids

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for request in group.children + ([group.shared_prefill] if group.shared_prefill else []):
            self.scheduler.finish(request, "abort")
            self._group_of.pop(request.request_id, None)
        if self._in_flight is not None and all(item.request.is_finished for item in self._in_flight[0].scheduled):
            self._in_flight = None  # nothing of it is wanted: its work on the device ends unread

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._deferred_groups) or self._in_flight is not None

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step. With async output processing, the text of the previous step's
        tokens (and its groups' outputs) is made while the device runs this step, and returned
        with this step's outputs that need no text; a request with stop strings has its text made
        at once (a stop string ends it before the next schedule).

        With async scheduling, a sampling step whose samples need nothing from the host before the
        next one (no grammar, no penalties) and that holds no prefill-only request is left running: the next call schedules and launches the step
        after it (its inputs take the sampled ids on the device), then applies this one's results
        while the device runs that one. A request whose step in flight ends it (a stop token, a stop
        string) may have computed one token more, which is dropped."""
        sched = self.scheduler.schedule()
        self.last_step_num_tokens = sched.num_tokens
        if not sched:
            if self._in_flight is not None:
                return self._land_in_flight()
            if self.scheduler.waiting and not self.scheduler.running and not sched.preempted:
                raise RuntimeError(
                    f"KV pool exhausted: {len(self.scheduler.waiting)} request(s) wait and none can be scheduled "
                    f"({self.kv.pool.num_free} free blocks); other models sharing the pool hold the rest"
                )
            return self._deferred_outputs()
        self.num_steps += 1
        self.num_tokens_computed += sched.num_tokens
        step = self.steps.build(sched)
        with self._workers_guard():
            if self.executor is not None:
                self.executor.send_step(self.model_key, step)
            launched = self.runner.launch(step)
        earlier = self._land_in_flight() if self._in_flight is not None else self._deferred_outputs()
        if self._may_leave_running(sched):
            self._advance(sched)
            self.num_steps_left_running += 1
            self._in_flight = (sched, launched)
            return earlier
        with self._workers_guard():
            result = self.runner.wait(launched)
        touched = self._apply(sched, result)
        return earlier + [self._make_output(g) for g in touched.values()
                          if g.request_id not in self._deferred_groups and _wants_output(g)]

    def _may_leave_running(self, sched) -> bool:
        """Async scheduling, some request samples this step, none is prefill-only (a verifier's
        readouts come back at once), and none needs its token on the host before its next step
        can be built (a grammar's next mask, penalties' token counts)."""
        if not self.async_scheduling or any(item.request.prefill_only for item in sched.scheduled):
            return False
        sampling = [item.request for item in sched.scheduled if item.completes_sequence]
        return bool(sampling) and not any(r.matcher is not None or _penalized(r.sampling_params) for r in sampling)

    def _advance(self, sched) -> None:
        """What the next schedule must see of a step left running: its tokens computed (their full
        blocks cached, blocks behind a window freed: any later step that reads or reuses them runs
        after this one on the device), and the token each request samples, in flight."""
        for item in sched.scheduled:
            request = item.request
            if request.is_finished:
                continue
            samples = item.completes_sequence
            request.num_computed_tokens += item.num_new_tokens
            request.num_in_flight += samples
            self.kv.cache_full_blocks(request)
            self.kv.free_behind_window(request)

    def _land_in_flight(self) -> list[RequestOutput]:
        """Waits for the step left running and applies its results; their outputs, text made."""
        sched, launched = self._in_flight
        self._in_flight = None
        with self._workers_guard():
            result = self.runner.wait(launched)
        touched = self._apply(sched, result, advanced=True)
        return [self._make_output(g) for g in touched.values()
                if g.request_id not in self._deferred_groups and _wants_output(g)] + self._deferred_outputs()

    def _apply(self, sched, result, advanced: bool = False) -> dict[str, RequestGroup]:
        """The step's results into the requests (computed tokens unless `advanced` counted them,
        cached blocks, logits, sampled tokens, finishes); returns the groups it touched. A request
        finished meanwhile (aborted, or ended by the step before) takes nothing."""
        for req_id, position, logits in result.readouts:
            self.steps.request(req_id).prompt_logits[position] = logits
        for req_id, position, entry in result.prompt_logprobs:
            self.steps.request(req_id).prompt_logprobs[position] = self.outputs.decoded_logprobs(entry)
        touched: dict[str, RequestGroup] = {}
        for item in sched.scheduled:
            request = item.request
            if request.is_finished:
                continue
            if not advanced:
                request.num_computed_tokens += item.num_new_tokens
            self.kv.cache_full_blocks(request)
            self.kv.free_behind_window(request)
            group = self._group_of[request.request_id]
            touched[group.request_id] = group
            if request.prefill_only:
                if request.num_computed_tokens == request.num_tokens:
                    self._finish_prefill(group, request)
            elif request.request_id in result.sampled:
                token_id, logprobs = result.sampled[request.request_id]
                request.num_in_flight -= advanced
                if self._append_token(request, token_id, logprobs):
                    self._deferred_groups[group.request_id] = group
        return touched

    @contextlib.contextmanager
    def _workers_guard(self):
        """With tensor parallelism, an error while the ranks work together becomes the error of the
        worker that caused it (`WorkerDiedError`, naming the rank); the engine stays failed."""
        if self.failed is not None:
            raise self.failed
        if self.executor is None:
            yield
            return
        try:
            yield
        except Exception as exc:
            self.failed = self.executor.failure(exc)
            if self.failed is exc:
                raise
            raise self.failed from exc

    def check_health(self) -> None:
        """Raises the error that stopped the engine, or a tensor-parallel worker's death (checked
        while idle too, so a server's /health turns 503 without waiting for a request)."""
        if self.failed is not None:
            raise self.failed
        if self.executor is not None:
            try:
                self.executor.check()
            except Exception as exc:
                self.failed = exc
                raise

    def close(self) -> None:
        """Stops the tensor-parallel workers this engine started and drops its CUDA graphs."""
        if self._owns_executor and self.executor is not None:
            self.executor.shutdown()
        self._in_flight = None
        if getattr(self, "runner", None) is not None:
            self.runner.graphs = None  # freed now, not by a later collection (steps after run eagerly)

    def _deferred_outputs(self) -> list[RequestOutput]:
        """The deferred tokens' text, then their groups' outputs (an aborted group's are dropped)."""
        if not self._deferred_groups:
            return []
        for request in self._deferred_text:
            self.outputs.make_text(request)  # no stop strings among these: it ends nothing
            if request.is_finished:
                self.outputs.finish_text(request, request.finish_reason, request.stop_reason)
        self._deferred_text.clear()
        groups, self._deferred_groups = self._deferred_groups, {}
        # an aborted group is gone; one whose id an abort freed and a new request took is not this group
        return [self._make_output(g) for g in groups.values() if self.groups.get(g.request_id) is g and _wants_output(g)]

    def _finish_prefill(self, group: RequestGroup, request: Request) -> None:
        if request is group.shared_prefill:
            group.first_scheduled_time = request.first_scheduled_time
            for child in group.children:
                self.kv.fork(request, child)
                child.num_cached_tokens = request.num_cached_tokens
                self._group_of[child.request_id] = group
                self.scheduler.add(child)
            self._group_of.pop(request.request_id, None)
            group.shared_prefill = None
        if request.keep_kv:
            self.scheduler.finish(request, "prefill", keep_blocks=True)
            self.retained.keep(group.request_id, request)
            return
        self.scheduler.finish(request, "prefill")

    def _append_token(self, request: Request, token_id: int, logprobs: dict | None) -> bool:
        """Appends the token and ends the request where it must; True when its text is deferred."""
        if self.async_output and not request.sampling_params.stop_strings:
            reason, stop_reason = self.outputs.append_token_id(request, token_id, logprobs)
            self._deferred_text.append(request)
        else:
            reason, stop_reason = self.outputs.append_token(request, token_id, logprobs)
        if reason is not None:
            self.scheduler.finish(request, reason, stop_reason)
        return self.async_output and bool(request.pending_text)

    def _make_output(self, group: RequestGroup) -> RequestOutput:
        output = self.outputs.make_output(group)
        if output.finished:
            self.groups.pop(group.request_id, None)
            for child in group.children:
                self._group_of.pop(child.request_id, None)
        return output


def _penalized(params: SamplingParams) -> bool:
    return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1


def _wants_output(group: RequestGroup) -> bool:
    return group.finished or not group.final_only
