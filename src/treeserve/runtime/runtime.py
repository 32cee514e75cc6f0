"""Several models in one process and on one device, owning the memory budget between them.

`kv_mode="shared"` (default): every model draws byte pages from one KV arena under one eviction
policy (engine/eviction.py), so an idle model's cached pages are evictable by a busy one and no
split needs tuning.
`kv_mode="static"`: each model gets a fixed fraction of the KV budget (the study's setting).
Verifiers (`scorer`, `score_steps`) are the models with a reward head or a recipe declared in their
config.json, and those `recipes` names (`{"prm": None}`: its declared recipe, else RLHFlow's):
runtime/roles.py says why a plain language model is not one unless named.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from treeserve.errors import ParamError
from treeserve.config import CPU_DEFAULT_KV_BYTES, EngineConfig, in_unit_interval
from treeserve.engine.engine_loop import EngineLoop
from treeserve.engine.kv_arena import aligned, fitted_page_bytes
from treeserve.engine.kv_space import KVSpace
from treeserve.engine.llm_engine import LLMEngine
from treeserve.engine.loaded_model import LoadedModel, load_model
from treeserve.engine.loaded_options import with_engine_options
from treeserve.engine.spec_decode.drafters import drafts_for
from treeserve.engine.tp_start import start_executor
from treeserve.engine.memory import available_host_bytes, cpu_kv_bytes
from treeserve.entrypoints.engine_args import config_fields
from treeserve.entrypoints.llm import LLM
from treeserve.outputs import RequestOutput
from treeserve.runtime.memory import (MemoryBreakdown, measure_activation_bytes, non_torch_bytes,
                                      weights_bytes)
from treeserve.runtime.parts import RuntimeParts
from treeserve.runtime.roles import not_a_verifier, verifier_recipe
from treeserve.runtime.scorer import StepScorer, given_item, given_question, given_steps
from treeserve.runtime.telemetry import TelemetryTrace

logger = logging.getLogger(__name__)

KV_MODES = ("shared", "static")
CPU_UTILISATION = 0.25  # on CPU, the share of available host memory for weights, activations and KV, unless given


class Runtime:
    def __init__(self, models: dict[str, str | Path | LoadedModel], kv_mode: str = "shared",
                 kv_fractions: dict[str, float] | None = None, recipes: dict[str, str | None] | None = None,
                 kv_cache_memory_bytes: int | None = None, memory_utilization: float | None = None,
                 trace_path: str | Path | None = None, **engine_options: Any):
        if not isinstance(models, dict) or not models:
            raise ParamError("models", f"give a dict of name -> model (a directory or builtin:NAME), e.g. "
                             f"Runtime({{'gen': 'builtin:arith-gen', 'prm': 'builtin:arith-prm'}}); got {models!r:.80}")
        engine_options = config_fields(engine_options, "Runtime")
        if kv_mode not in KV_MODES:
            raise ParamError("kv_mode", f"must be one of {KV_MODES}, got {kv_mode!r}")
        if memory_utilization is not None and not in_unit_interval(memory_utilization):
            raise ParamError("memory_utilization", f"must be in (0, 1], got {memory_utilization!r}")
        _check_named(models, kv_mode, kv_fractions, recipes)
        self.kv_mode = kv_mode
        # A loaded model (`load_model`) keeps its weights: Runtimes built one after another over the
        # same weights (a benchmark's configurations) load them once. The engine options apply to the
        # engines over it; a load-level one (dtype, device, ...) must equal what it was loaded with.
        given = {name: with_engine_options(m, engine_options) for name, m in models.items() if isinstance(m, LoadedModel)}
        configs = {name: EngineConfig(model=path, **engine_options) for name, path in models.items() if name not in given}
        self.executor = self._workers(next(iter(configs.values()))) if configs else None
        # what `close` frees, held by the engines too (runtime/parts.py): an engine its caller keeps keeps them
        self._parts = RuntimeParts(self.executor)
        try:  # anything failing from here stops the tensor-parallel workers it started
            loaded = {name: given[name] if name in given else load_model(configs[name], name, self.executor)
                      for name in models}
            self._parts.loaded.extend(m for name, m in loaded.items() if name not in given)
            _drafters_where_they_fit(loaded)
            self.memory = self._account(loaded, kv_cache_memory_bytes, memory_utilization)
            if kv_mode == "shared":
                self.engines = self._build_shared(loaded)
            else:
                self.engines = self._build_static(loaded, _fractions(kv_fractions, list(loaded)))
            self.trace = self._parts.held.trace = TelemetryTrace(trace_path) if trace_path else None
        except BaseException:
            self.close()
            raise
        # the verifiers' recipes: models with a reward head or a declared recipe, and those `recipes` names
        named = recipes or {}
        self.recipes = {name: recipe for name in self.engines
                        if (recipe := verifier_recipe(loaded[name].model_dir, name in named, named.get(name)))}
        # The one owner that steps these engines: generation, scoring and search all go through it.
        self.loop = EngineLoop(self.engines)
        self._llms = {name: LLM.from_engine(engine, self.loop) for name, engine in self.engines.items()}
        self._scorers: dict[str, StepScorer] = {}
        if self.trace:
            self.loop.step_observers.append(self.trace.observe)

    # ---- memory ---------------------------------------------------------------------------
    def _account(self, loaded: dict[str, LoadedModel], kv_bytes: int | None,
                 utilisation: float | None) -> dict[str, MemoryBreakdown]:
        models = list(loaded.values())
        rows = {name: MemoryBreakdown(name, weights_bytes(m), measure_activation_bytes(m), 0)
                for name, m in loaded.items()}
        outside = non_torch_bytes(models)
        for row in rows.values():
            row.non_torch_bytes = outside // len(rows)
        device, fraction = models[0].device, None  # (cpu_kv_memory_fraction is CPU's alone, as LLM(...) reads it)
        if device.type == "cuda":
            self.total_bytes = torch.cuda.mem_get_info(device)[1]
            self.utilisation = models[0].config.gpu_memory_utilization if utilisation is None else utilisation
        else:
            self.total_bytes = available_host_bytes()
            fraction = _cpu_kv_fraction(models, utilisation)
            self.utilisation = CPU_UTILISATION if utilisation is None else utilisation
            if fraction is not None:
                self.utilisation = None  # (the KV budget is `fraction` of total_bytes, the weights apart)
        if kv_bytes is not None:
            self.kv_budget = kv_bytes
        elif fraction is not None:  # (the KV alone, as LLM(...)'s: the weights, loaded, are not in what is available)
            self.kv_budget = cpu_kv_bytes(fraction)
        else:
            used = sum(r.weights_bytes + r.activation_bytes + r.non_torch_bytes for r in rows.values())
            self.kv_budget = int(self.total_bytes * self.utilisation) - used
            if device.type != "cuda":
                self.kv_budget = min(self.kv_budget, CPU_DEFAULT_KV_BYTES)
        if self.kv_budget <= 0:
            raise ParamError("kv_cache_memory_bytes", "no memory is left for KV blocks after weights and activations")
        return rows

    def _build_shared(self, loaded: dict[str, LoadedModel]) -> dict[str, LLMEngine]:
        models = loaded.values()
        # Pages fit the smallest model's block; a larger model puts fewer tokens in each page. Sizing
        # pages for the largest model instead would leave most of every small-model page idle.
        page = fitted_page_bytes([m.kv_bytes_per_token() for m in models], min(m.config.block_size for m in models))
        first = next(iter(models))
        # kept sequences of any model give way before any model's shared prefixes are evicted ...
        engines: dict[str, LLMEngine] = {}
        held: dict[str, weakref.ref] = {}  # (the reclaim callbacks hold the engines weakly: no cycle, runtime/parts.py)
        space = KVSpace.create(self.kv_budget, page, first.device, first.config.enable_prefix_caching,
                               reclaim=lambda owner: _reclaimer(held, owner)())
        self._parts.spaces.append(space)
        for name, model in loaded.items():  # ... and before anything is preempted
            engines[name] = LLMEngine(model, space, reclaim=_reclaimer(held, name), owner=self._parts)
            self._parts.add_engine(engines[name])
            held[name] = weakref.ref(engines[name])
            self._note_kv(name, engines[name], space.pool.num_blocks * space.arena.page_bytes)
        return engines

    def _build_static(self, loaded: dict[str, LoadedModel], fractions: dict[str, float]) -> dict[str, LLMEngine]:
        engines = {}
        for name, model in loaded.items():
            page = model.config.block_size * model.kv_bytes_per_token()
            space = KVSpace.create(int(self.kv_budget * fractions[name]), page, model.device,
                                   model.config.enable_prefix_caching)
            self._parts.spaces.append(space)
            engines[name] = LLMEngine(model, space, owner=self._parts)
            self._parts.add_engine(engines[name])
            self._note_kv(name, engines[name], space.pool.num_blocks * aligned(page))
        return engines

    def _note_kv(self, name: str, engine: LLMEngine, kv_bytes: int) -> None:
        row, stats = self.memory[name], engine.stats()
        row.kv_bytes, row.kv_blocks = kv_bytes, stats.kv_blocks_total
        row.block_size, row.kv_bytes_per_token = stats.block_size, engine.kv_bytes_per_token()

    # ---- work -----------------------------------------------------------------------------
    def engine(self, name: str) -> LLMEngine:
        if name not in self.engines:
            raise ParamError("model", f"unknown model {name!r}; loaded: {', '.join(self.engines)}")
        return self.engines[name]

    def generate(self, name: str, prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        self.engine(name).require_open()
        return self._llms[name].generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def scorer(self, name: str) -> StepScorer:
        """The step scorer of a verifier (`recipes`); any other model is a ParamError saying why."""
        self.engine(name).require_open()
        if name not in self.recipes:
            raise ParamError("model", not_a_verifier(name, list(self.recipes),
                                                     f"is read as one when recipes names it: recipes={{{name!r}: None}}"))
        if name not in self._scorers:
            self._scorers[name] = StepScorer(self.engine(name), self.recipes[name],
                                             loop=self.loop)
        return self._scorers[name]

    def score_steps(self, name: str, question: str, steps: list[str]) -> list[float]:
        scorer = self.scorer(name)
        return self._scored(scorer, [(given_question(question), given_steps(steps))])[0]

    def score_many(self, name: str, items: list[tuple[str, list[str]]]) -> list[list[float]]:
        """Direct scoring: a conversation too long for the verifier is an error, not a 0, and so is an
        empty question or step (naming `items[i]`, as the server's scoring routes answer 400). Steps are
        stripped as the server's scoring routes strip them (`given_steps`): the same scores."""
        scorer = self.scorer(name)
        return self._scored(scorer, [given_item(item, f"items[{i}]") for i, item in enumerate(items)])

    @staticmethod
    def _scored(scorer: StepScorer, items: list[tuple[str, list[str]]]) -> list[list[float]]:
        for question, steps in items:
            scorer.require_readable(question, steps)
        return scorer.score_many(items)

    def release_kept(self) -> None:
        for scorer in self._scorers.values():
            scorer.release_all()

    def reset_prefix_cache(self) -> bool:
        """Forgets what every model has cached: kept conversations, scores and prefix-cached KV
        (a benchmark's runs start equal). False while a request still holds blocks."""
        self.release_kept()
        for scorer in self._scorers.values():
            scorer.score_cache.clear()
        return all([engine.reset_prefix_cache() for engine in self.engines.values()])

    @staticmethod
    def _workers(config: EngineConfig):
        """With tensor parallelism, one set of workers for every model: rank r holds shard r of each."""
        if config.tensor_parallel_size == 1:
            return None
        return start_executor(config, config.resolve_device())

    def close(self) -> None:
        """Closes the trace and the engines, frees the KV arena and the weights of the models it
        loaded (those given to it loaded are their caller's) now, whoever still refers to the
        Runtime or its engines, and stops the tensor-parallel workers, if any. Afterwards, `generate`,
        `scorer` and the scoring calls raise EngineClosedError; `engines` and their `stats()` stay
        readable. Idempotent. Without it, all of that goes as soon as neither the Runtime nor any of
        its engines is referenced (runtime/parts.py): an engine kept keeps working."""
        self._parts.free()  # (the engines first, each after a step under way, then their memory)


def _reclaimer(engines: dict[str, weakref.ref], first: str):
    """Releases one kept sequence: `first`'s own if it keeps any, else another model's. The engines
    hold this: it holds them weakly (one let go of has given its blocks back: LLMEngine), so that they, and the
    Runtime's memory, go with their last reference."""
    def reclaim() -> bool:
        alive = {name: engine for name, ref in engines.items() if (engine := ref()) is not None}
        order = [alive[first]] if first in alive else []
        order += [e for name, e in alive.items() if name != first]
        return any(e.reclaim_one() for e in order)
    return reclaim


def _cpu_kv_fraction(models: list[LoadedModel], utilisation: float | None) -> float | None:
    """The models' `cpu_kv_memory_fraction` (the Runtime's option, or what they were loaded with): the
    share of available host memory for all their KV together, as LLM(...)'s for its one model; None if
    none has one. With `memory_utilization` (weights and activations in the same share) a ParamError."""
    given = {m.config.cpu_kv_memory_fraction for m in models} - {None}
    if len(given) > 1:
        raise ParamError("cpu_kv_memory_fraction", f"the models were loaded with different ones ({sorted(given)}): "
                         "their KV is one budget, give the Runtime one (cpu_kv_memory_fraction=...)")
    fraction = next(iter(given), None)
    if fraction is not None and utilisation is not None:
        raise ParamError("cpu_kv_memory_fraction", f"{fraction} and memory_utilization={utilisation} both size the "
                         "KV budget: give one (cpu_kv_memory_fraction: the share of available host memory for KV "
                         "alone, as LLM's; memory_utilization: for weights, activations and KV together)")
    return fraction


def _fractions(given: dict[str, float] | None, names: list[str]) -> dict[str, float]:
    if given is None:
        return {name: 1.0 / len(names) for name in names}
    if set(given) != set(names):
        raise ParamError("kv_fractions", f"give one fraction per model ({', '.join(names)})")
    if any(not 0 < f < 1 for f in given.values()) or sum(given.values()) > 1.0 + 1e-9:
        raise ParamError("kv_fractions", f"each must be in (0, 1) and they must sum to at most 1, got {given}")
    return dict(given)


def _drafters_where_they_fit(loaded: dict[str, LoadedModel]) -> None:
    """A drafter (`speculative_config` with a `model`: a draft model, an EAGLE head) drafts for the
    models it fits (a search's generator); the others (a PRM of another family) decode without
    one, said in the log. Fitting no model is an error (from the first engine)."""
    configs = {m.config.speculative_config for m in loaded.values()}
    for config in configs:
        if config is None or config.model is None:
            continue
        users = [m for m in loaded.values() if m.config.speculative_config == config]
        others = [m for m in users if not drafts_for(config, m)]
        if len(others) == len(users):
            continue  # (the first engine names the mismatch)
        for model in others:
            logger.warning("speculative_config: %s %s does not fit %s, which decodes without speculation",
                           config.method, config.model, model.model_key)
            model.config = replace(model.config, speculative_config=None)


def _check_named(models: dict, kv_mode: str, kv_fractions: dict | None, recipes: dict | None) -> None:
    """What names no served model, names no recipe, or has no effect in this mode is a ParamError
    (each was dropped: a recipe for a misspelled model, fractions of a shared arena)."""
    from treeserve.runtime.prm_recipes import RECIPES

    if kv_fractions and kv_mode == "shared":
        raise ParamError("kv_fractions", 'split a static budget: give them with kv_mode="static" (a shared arena '
                         "has no split)")
    for name, recipe in (recipes or {}).items():
        if name not in models:
            raise ParamError("recipes", f"{name!r} is not one of the models ({', '.join(models)})")
        if recipe is not None and recipe not in RECIPES:
            raise ParamError("recipes", f"{name}: unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
