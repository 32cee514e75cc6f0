"""The engine's outside: built complete in one step, read through `stats()`, stepped by its one loop.

Nothing outside `engine/` reads the engine's rooms (scheduler, KV manager, kept sequences, runner);
each engine has exactly one `EngineLoop`, which the scorer, the search runner and the async engine
take rather than make."""
import ast
from pathlib import Path

import pytest

from treeserve import LLM, Runtime, SamplingParams
from treeserve.engine.async_engine import AsyncLLMEngine
from treeserve.engine.engine_loop import EngineLoop
from treeserve.engine.engine_stats import EngineStats
from treeserve.search.runner import SearchRunner

ROOT = Path(__file__).resolve().parents[1]
ENGINE_DIR = ROOT / "src" / "treeserve" / "engine"
INSIDES = {"scheduler", "kv", "retained"}  # names no other object in the code base uses
OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=256)


def _reads_of_insides(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        receiver = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        if node.attr in INSIDES or (node.attr == "runner" and "engine" in receiver):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    return found


def test_no_module_outside_the_engine_reads_its_insides():
    sources = [p for folder in ("src", "benchmarks", "scripts") for p in (ROOT / folder).rglob("*.py")
               if ENGINE_DIR not in p.parents]
    offenders = [hit for path in sources for hit in _reads_of_insides(path)]
    assert not offenders, f"read EngineStats (engine.stats()) instead: {offenders}"
    inside = [hit for path in ENGINE_DIR.rglob("*.py") for hit in _reads_of_insides(path)]
    assert inside, "the check must see the engine's own reads"


def test_an_engine_has_one_loop_that_everyone_takes(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), **OPTIONS)
    with pytest.raises(RuntimeError, match="already driven by an engine loop"):
        EngineLoop(llm.engine)
    assert EngineLoop.of(llm.engine) is llm.loop
    assert AsyncLLMEngine(llm.engine, start_thread=False).loop is llm.loop
    assert SearchRunner(llm.engine, None).loop is llm.loop

    rt = Runtime({"gen": tiny_model_dirs["llama"], "prm": tiny_model_dirs["qwen2"]}, recipes={"prm": "rlhflow"},
                 **OPTIONS)
    assert rt.scorer("prm").loop is rt.loop
    assert SearchRunner(rt.engine("gen"), None).loop is rt.loop
    assert EngineLoop.of(rt.engines) is rt.loop
    with pytest.raises(RuntimeError, match="different engine loops"):
        EngineLoop.of([llm.engine, rt.engine("gen")])


def test_stats_show_queues_blocks_and_counters(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), **OPTIONS)
    before = llm.engine.stats()
    assert isinstance(before, EngineStats) and before.num_steps == 0 and before.kv_blocks_in_use == 0
    assert before.kv_blocks_free == before.kv_blocks_total > 0 and before.kv_blocks_cached is None
    prompt = {"prompt_token_ids": list(range(3, 3 + 40))}  # more than two full blocks of 16
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    once = llm.engine.stats(count_cached=True)
    assert once.num_steps > 0 and once.num_tokens_computed >= 40 + 3
    assert once.kv_blocks_in_use == 0 and once.num_running == once.num_waiting == 0
    assert once.kv_blocks_cached >= 2, "the prompt's full blocks stay cached"
    llm.generate([prompt], params, use_tqdm=False)
    twice = llm.engine.stats()
    assert twice.prefix_queries > once.prefix_queries and twice.prefix_hits - once.prefix_hits >= 32
    assert twice.kv_arena_bytes >= twice.kv_blocks_total * twice.block_size * llm.engine.kv_bytes_per_token()


def test_stats_count_each_requests_prompt_once_and_every_generated_token(tiny_model_dirs):
    """vLLM's prompt_tokens and generation_tokens, as the engine does the work (the server's counters
    read them after every step, streamed or not): an n=2 request's prompt once (its usage), both
    samples' tokens."""
    llm = LLM(str(tiny_model_dirs["llama"]), **OPTIONS)
    prompt = {"prompt_token_ids": list(range(3, 3 + 20))}
    [output] = llm.generate([prompt], SamplingParams(max_tokens=4, n=2, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_prompt_tokens == 20
    assert stats.num_generation_tokens == sum(len(c.token_ids) for c in output.outputs) == 8
