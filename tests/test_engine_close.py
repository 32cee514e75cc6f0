"""`close()` frees an engine's memory now, whoever still refers to it (a notebook variable, FastAPI's
route caches holding an app's endpoints): it used to drop only the CUDA graphs, and a closed but
referenced engine kept its KV arena (1 GiB by default on CPU) and its weights. After close, what
would run the model raises EngineClosedError; statistics stay readable."""
import asyncio
import threading

import pytest

from treeserve import LLM, Runtime, SamplingParams
from treeserve.engine.async_engine import AsyncLLMEngine
from treeserve.engine.engine_loop import EngineLoop
from treeserve.errors import EngineClosedError, EngineDeadError

OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=256)
QUESTION = "Add two and three, then double it."


def _storage_bytes(tensor) -> int:
    return tensor.untyped_storage().nbytes()


def test_closing_an_llm_frees_its_kv_arena_and_weights_under_every_reference(llama_dir):
    llm = LLM(str(llama_dir), **OPTIONS)
    llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)
    engine = llm.llm_engine
    pages, layer_view = engine.runner.arena.pages, engine.runner.kv_caches[0]
    weights = [p for p in engine.model.parameters()]
    assert _storage_bytes(pages) == 8 << 20 and all(_storage_bytes(w) > 0 for w in weights)
    llm.close()
    # (the test still holds the LLM, the engine, the arena's tensor, a layer's view and every weight)
    assert _storage_bytes(pages) == 0 and _storage_bytes(layer_view) == 0
    # (an embedding read in place from the checkpoint file is not the process's memory to resize: its
    # mapping goes with the last reference, and the model holds none)
    assert all(_storage_bytes(w) == 0 for w in weights if w.untyped_storage().resizable())
    assert all(p.numel() == 0 for p in engine.loaded.model.parameters())
    assert engine.model is None and engine.runner.kv_caches == []


def test_a_closed_llm_says_so_and_keeps_its_statistics(llama_dir):
    llm = LLM(str(llama_dir), **OPTIONS)
    llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)
    engine = llm.llm_engine
    before = engine.stats()
    llm.close()
    llm.close()  # (twice: nothing more)
    engine.close()
    assert engine.stats() == before and engine.num_tokens_computed == before.num_tokens_computed > 0
    assert engine.stats().kv_arena_bytes == 8 << 20
    name = llama_dir.name
    with pytest.raises(EngineClosedError, match=rf"engine '{name}' is closed"):
        llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)
    with pytest.raises(EngineClosedError, match="is closed"):
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3), use_tqdm=False)
    with pytest.raises(EngineClosedError, match="is closed"):
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3))
    with pytest.raises(EngineClosedError, match="is closed"):
        engine.step()


def test_a_runtime_closed_frees_its_arena_and_the_weights_it_loaded_and_keeps_its_statistics(pair):
    rt = Runtime(pair, **OPTIONS)
    rt.generate("gen", ["Hello"], SamplingParams(max_tokens=4))
    rt.score_steps("prm", QUESTION, ["First add.", "Then double."])
    pages = rt.engines["gen"].runner.arena.pages
    assert pages is rt.engines["prm"].runner.arena.pages  # (one shared arena)
    weights = [p for e in rt.engines.values() for p in e.model.parameters() if p.untyped_storage().resizable()]
    tokens = {name: e.num_tokens_computed for name, e in rt.engines.items()}
    stats = {name: e.stats() for name, e in rt.engines.items()}
    rt.close()
    rt.close()
    assert _storage_bytes(pages) == 0 and all(_storage_bytes(w) == 0 for w in weights)
    assert all(p.numel() == 0 for e in rt.engines.values() for p in e.loaded.model.parameters())
    # what benchmarks/memory_split.py reads after close
    assert {name: e.num_tokens_computed for name, e in rt.engines.items()} == tokens
    assert {name: e.stats() for name, e in rt.engines.items()} == stats
    assert rt.engine("gen").stats().kv_arena_bytes == stats["gen"].kv_arena_bytes > 0
    with pytest.raises(EngineClosedError, match="engine 'gen'"):
        rt.generate("gen", ["Hello"], SamplingParams(max_tokens=4))
    with pytest.raises(EngineClosedError, match="engine 'prm'"):
        rt.score_steps("prm", QUESTION, ["First add."])
    with pytest.raises(EngineClosedError, match="engine 'prm'"):
        rt.score_many("prm", [(QUESTION, ["First add."])])


def test_a_runtime_over_given_loaded_models_leaves_their_weights_to_their_caller(pair):
    """Runtimes built one after another over the same loaded models (a benchmark's configurations):
    closing one frees its arena, not the weights the next one runs."""
    from treeserve.config import EngineConfig
    from treeserve.engine.loaded_model import load_model

    options = dict(dtype="float32", device="cpu", max_model_len=192, max_num_batched_tokens=192)
    loaded = {name: load_model(EngineConfig(model=str(path), **options), name) for name, path in pair.items()}
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    first = Runtime(loaded, kv_cache_memory_bytes=8 << 20)
    expected = first.generate("gen", ["Hello"], greedy)[0].outputs[0].token_ids
    pages = first.engines["gen"].runner.arena.pages
    first.close()
    assert _storage_bytes(pages) == 0
    assert all(_storage_bytes(p) > 0 for m in loaded.values() for p in m.model.parameters())
    second = Runtime(loaded, kv_cache_memory_bytes=8 << 20)
    assert second.generate("gen", ["Hello"], greedy)[0].outputs[0].token_ids == expected
    second.close()


def test_a_request_in_flight_on_the_engine_loop_at_close_fails_with_the_closed_error(llama_dir):
    llm = LLM(str(llama_dir), **OPTIONS)
    loop, outputs = EngineLoop.of(llm.engine), []
    loop.add_request(llm.engine, "long", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True),
                     outputs.append)
    loop.step()
    llm.close()
    with pytest.raises(EngineClosedError, match="is closed"):
        loop.run_until(lambda: bool(outputs) and outputs[-1].finished)


def test_a_streamed_request_on_an_async_engine_ends_with_an_error_when_its_engine_closes(llama_dir):
    """The engine thread steps while another thread closes the engine: the close waits for the step
    under way, and the stream ends with the engine's error instead of hanging."""
    llm = LLM(str(llama_dir), **OPTIONS)
    served = AsyncLLMEngine(llm.engine)  # (its own engine thread)
    params = SamplingParams(max_tokens=250, ignore_eos=True)

    async def stream() -> int:
        count = 0
        async for _ in served.generate([1, 2, 3], params, "long"):
            count += 1
            if count == 3:
                threading.Thread(target=llm.close).start()
        return count

    async def run() -> None:
        with pytest.raises(EngineDeadError, match="is closed") as caught:
            await asyncio.wait_for(stream(), timeout=60)
        assert isinstance(caught.value.cause, EngineClosedError)

    try:
        asyncio.run(run())
    finally:
        served.shutdown()
    assert llm.llm_engine.closed and llm.llm_engine.stats().num_tokens_computed >= 3


def _close_mid_forward(engine, close) -> None:
    """`close` runs on the stepping thread inside the model's forward, as a finalizer does when the
    garbage collector runs on the engine thread mid-step (an app holding a Runtime dropped while its
    engine thread still steps): the lock the step holds lets the same thread in."""
    calls = []

    def hook(module, args):
        if not calls:
            calls.append(1)
            close()

    engine.model.layers[-1].register_forward_pre_hook(hook)


def test_a_close_from_the_stepping_thread_waits_for_the_step_under_way(llama_dir):
    llm = LLM(str(llama_dir), **OPTIONS)
    engine = llm.llm_engine
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    weights = [p for p in engine.model.parameters() if p.untyped_storage().resizable()]
    pages = engine.runner.arena.pages
    _close_mid_forward(engine, llm.close)
    engine.step()  # (the step under way finishes on the memory it started with)
    assert engine.closed and _storage_bytes(pages) == 0 and all(_storage_bytes(w) == 0 for w in weights)
    with pytest.raises(EngineClosedError, match="is closed"):
        engine.step()


def test_a_runtime_finalized_on_its_stepping_thread_frees_its_memory_after_the_step(pair):
    rt = Runtime(pair, **OPTIONS)
    engine = rt.engines["gen"]
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    pages = engine.runner.arena.pages
    _close_mid_forward(engine, rt.close)
    engine.step()
    assert all(e.closed for e in rt.engines.values()) and _storage_bytes(pages) == 0
    with pytest.raises(EngineClosedError, match="engine 'gen'"):
        rt.generate("gen", ["Hello"], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("closed_by", ["close()", "the interpreter's exit"])
def test_a_runtime_closed_mid_step_ends_the_loop_step_without_writing_to_its_closed_trace(pair, tmp_path, closed_by):
    """A Runtime still held at the interpreter's exit (a script's, its engine on a daemon thread mid-step):
    the exit's finalizer of its parts (runtime/parts.py) freed the KV pages and weights under the step
    under way, closing no engine (a segmentation fault as the process ended). It closes the engines first,
    each after its step, as `close()` does."""
    rt = Runtime(pair, trace_path=tmp_path / "trace.jsonl", **OPTIONS)
    engine, outputs = rt.engines["gen"], []
    pages, seen = engine.runner.arena.pages, []
    rt.loop.add_request(engine, "r", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), outputs.append)
    rt.loop.step()
    free = rt.close if closed_by == "close()" else rt._parts.free
    assert rt._parts.free.atexit  # (what the interpreter's exit runs)
    _close_mid_forward(engine, lambda: (free(), seen.append(_storage_bytes(pages))))
    rt.loop.step()  # (the step's observers run after the close: the closed trace records nothing more)
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    assert seen[0] > 0, "the KV pages were freed under the step"
    assert engine.closed and len(lines) >= 1
    assert _storage_bytes(pages) == 0
    with pytest.raises(EngineClosedError, match="engine 'gen'"):
        rt.loop.step()


def test_a_runtime_let_go_of_while_an_async_engine_serves_its_engines_keeps_serving(pair):
    """`AsyncLLMEngine(Runtime(...).engines)`: the Runtime, dropped, closed the engines its engine thread
    served (the stream ended with EngineDeadError). Now they keep their memory while served; another
    Runtime let go of is freed at once, and a collection on that thread mid-step frees nothing of the
    one stepping; shut down and let go of, all of it is freed."""
    import gc

    rt, other = Runtime(pair, **OPTIONS), Runtime(pair, **OPTIONS)
    served = AsyncLLMEngine(rt.engines, loop=rt.loop)
    pages, other_pages = rt.engines["gen"].runner.arena.pages, other.engines["gen"].runner.arena.pages
    collected_on = []

    def collect(module, args):  # (the engine thread, inside the model's forward)
        if not collected_on:
            collected_on.append(threading.current_thread())
            gc.collect()

    rt.engines["gen"].model.layers[-1].register_forward_pre_hook(collect)
    del rt, other
    assert _storage_bytes(other_pages) == 0

    async def stream() -> int:
        return len([o async for o in served.generate([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), "r")])

    try:
        assert asyncio.run(asyncio.wait_for(stream(), timeout=60)) == 20
        assert collected_on and collected_on[0] is not threading.current_thread()
        assert _storage_bytes(pages) > 0
    finally:
        served.shutdown()
    del served, collect
    gc.collect()
    assert _storage_bytes(pages) == 0


def test_a_runtime_over_a_given_tensor_parallel_model_leaves_its_workers_to_their_caller(llama_dir):
    """(closing the Runtime stopped the tensor-parallel workers the loaded model had started, its caller's:
    the next Runtime over it failed at its first step)"""
    from treeserve.config import EngineConfig
    from treeserve.engine.loaded_model import load_model

    config = EngineConfig(model=str(llama_dir), dtype="float32", device="cpu", max_model_len=128,
                          max_num_batched_tokens=128, tensor_parallel_size=2, threads_per_rank=1)
    loaded = load_model(config, "gen")
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    try:
        first = Runtime({"gen": loaded}, kv_cache_memory_bytes=4 << 20)
        expected = first.generate("gen", ["Hello"], greedy)[0].outputs[0].token_ids
        first.close()
        assert not loaded.executor.closed and all(p.is_alive() for p in loaded.executor.procs)
        second = Runtime({"gen": loaded}, kv_cache_memory_bytes=4 << 20)
        assert second.generate("gen", ["Hello"], greedy)[0].outputs[0].token_ids == expected
        second.close()
    finally:
        loaded.close()
        loaded.release_weights()
