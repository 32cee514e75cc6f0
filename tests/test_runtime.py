"""Several models in one process: shared and static KV, memory accounting, scoring through the Runtime."""
import gc
import re
import threading
import weakref

import pytest

from conftest import assert_no_leak
from treeserve import Runtime, SamplingParams
from treeserve.errors import ParamError
from treeserve.engine.kv_arena import fitted_page_bytes
from treeserve.testing.tiny_models import make_tiny_model

QUESTION = "Add two and three, then double it."


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    gen = make_tiny_model("llama", root / "gen", seed=3)
    prm = make_tiny_model("qwen3", root / "prm", seed=4, hidden_size=96, num_hidden_layers=3,
                          prm_recipe="rlhflow")  # (a verifier: runtime/roles.py)
    return {"gen": gen, "prm": prm}


def _runtime(pair, **options):
    options.setdefault("kv_cache_memory_bytes", 8 << 20)
    return Runtime(pair, dtype="float32", device="cpu", max_model_len=192, max_num_batched_tokens=192, **options)


def _search_like(rt, rounds=3, width=6):
    """Generate candidate steps, score them, extend the best: both models busy, sharing KV memory."""
    steps: list[str] = []
    trace = []
    for r in range(rounds):
        prompt = QUESTION + " " + " ".join(steps)
        params = SamplingParams(n=width, temperature=1.0, seed=100 + r, max_tokens=12, ignore_eos=True)
        candidates = [c.text for c in rt.generate("gen", [prompt], params)[0].outputs]
        scores = rt.score_many("prm", [(QUESTION, steps + [c]) for c in candidates])
        best = max(range(width), key=lambda i: scores[i][-1])
        steps.append(candidates[best])
        trace.append((candidates, scores))
    return trace


def test_shared_mode_under_tight_memory_matches_ample(pair):
    rt = _runtime(pair)
    ample = _search_like(rt)
    # (a page's size is the models', not the budget's: read off the ample runtime, not one sized by the
    # host's free memory, which a busy machine can leave too small for any KV block)
    gen_page = rt.engines["gen"].kv.block_size * rt.engines["gen"].kv_bytes_per_token()
    tight = _runtime(pair, kv_cache_memory_bytes=36 * gen_page)  # fewer pages than both need at peak
    assert tight.engines["gen"].kv.pool is tight.engines["prm"].kv.pool
    result = _search_like(tight)
    assert [c for c, _ in result] == [c for c, _ in ample]
    _assert_scores_close(result, ample)
    pool = tight.engines["gen"].kv.pool
    assert pool.stats.evictions > 0 or tight.engines["gen"].scheduler.num_preemptions > 0
    tight.release_kept()
    for engine in tight.engines.values():
        assert_no_leak(engine)


def _assert_scores_close(a, b):
    flat_a = [x for _, s in a for row in s for x in row]
    flat_b = [x for _, s in b for row in s for x in row]
    assert flat_a == pytest.approx(flat_b, abs=1e-5)


def test_shared_pages_are_cut_to_fit_every_model_where_that_returns_memory():
    """2 and 6 KiB per token: 16-token pages would leave 2 of every 32 KiB idle in the verifier's
    pages, 15-token pages leave none. A sliver of idle memory does not cut the page."""
    assert fitted_page_bytes([2048, 6144], 16) == 15 * 2048
    assert fitted_page_bytes([512, 1152], 16) == 16 * 512  # 16 tokens idle 0.8%: kept
    assert fitted_page_bytes([4096, 4096], 16) == 16 * 4096
    assert fitted_page_bytes([100], 1) == 100


def test_pages_are_sized_in_bytes_for_different_shapes(pair):
    rt = _runtime(pair)
    gen, prm = rt.engines["gen"], rt.engines["prm"]
    assert gen.kv_bytes_per_token() != prm.kv_bytes_per_token()
    page = gen.runner.arena.page_bytes
    assert gen.runner.arena is prm.runner.arena
    assert gen.kv.block_size * gen.kv_bytes_per_token() <= page
    assert prm.kv.block_size * prm.kv_bytes_per_token() <= page
    assert gen.kv.block_size > prm.kv.block_size  # the smaller model packs more tokens per page


def test_static_mode_splits_the_budget(pair):
    rt = _runtime(pair, kv_mode="static", kv_fractions={"gen": 0.25, "prm": 0.75})
    gen, prm = rt.engines["gen"], rt.engines["prm"]
    assert gen.kv.pool is not prm.kv.pool
    assert rt.memory["gen"].kv_bytes < rt.memory["prm"].kv_bytes
    assert rt.memory["gen"].kv_bytes + rt.memory["prm"].kv_bytes <= 8 << 20


def test_memory_breakdown_is_measured(pair):
    rt = _runtime(pair)
    for name, row in rt.memory.items():
        params = sum(p.numel() * 4 for p in rt.engines[name].model.parameters())
        assert row.weights_bytes == params
        assert row.activation_bytes > 0
        assert row.kv_blocks == rt.engines[name].kv.pool.num_blocks
        # the dry run that measured activations is not counted as work done
        assert (rt.engines[name].num_steps, rt.engines[name].num_tokens_computed) == (0, 0)


@pytest.mark.parametrize("options, name", [
    (dict(kv_mode="split"), "kv_mode"),
    (dict(kv_mode="static", kv_fractions={"gen": 0.9, "prm": 0.9}), "kv_fractions"),
    (dict(kv_mode="static", kv_fractions={"gen": 0.5}), "kv_fractions"),
    (dict(cpu_kv_memory_fraction=0.1, memory_utilization=0.5), "cpu_kv_memory_fraction"),  # (both size the KV)
    (dict(cpu_kv_memory_fraction=0), "cpu_kv_memory_fraction"),
    (dict(cpu_kv_memory_fraction=1.5), "cpu_kv_memory_fraction"),
    (dict(cpu_kv_memory_fraction="0.1"), "cpu_kv_memory_fraction"),
    (dict(memory_utilization=0), "memory_utilization"),
    (dict(memory_utilization=2.0), "memory_utilization"),
])
def test_bad_runtime_options(pair, options, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        _runtime(pair, **options)


@pytest.mark.parametrize("given_loaded", [False, True])
def test_a_runtime_on_cpu_sizes_its_kv_by_cpu_kv_memory_fraction_as_llm_does(pair, monkeypatch, capsys, given_loaded):
    """`cpu_kv_memory_fraction` (LLM's: the share of available host memory for KV blocks alone) sized nothing
    in a Runtime, over model paths or loaded models: it took 0.25 of that memory less weights, activations and
    the rest of the process (at most 1 GiB) whatever it was given. All its models' KV together is that share
    now, as an LLM's one model's is (vLLM's CPU backend, too, sizes its KV alone: VLLM_CPU_KVCACHE_SPACE)."""
    from treeserve import LLM
    from treeserve.cli import main
    from treeserve.config import EngineConfig
    from treeserve.engine import memory
    from treeserve.engine.loaded_model import load_model

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 256 << 20)  # (the machine's, held still)
    options = dict(dtype="float32", device="cpu", max_model_len=192, max_num_batched_tokens=192)
    models = ({name: load_model(EngineConfig(model=str(path), **options), name) for name, path in pair.items()}
              if given_loaded else pair)
    rt = Runtime(models, cpu_kv_memory_fraction=0.125, **options)
    llm = LLM(str(pair["gen"]), cpu_kv_memory_fraction=0.125, **options)
    try:
        assert rt.kv_budget == 32 << 20 == llm.engine.kv.pool.num_blocks * llm.engine.runner.arena.page_bytes
        assert 30 << 20 < rt.memory["gen"].kv_bytes <= 32 << 20  # (the shared arena: whole pages of it)
        assert rt.generate("gen", ["Hello"], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids
    finally:
        rt.close()
        llm.close()
    assert main(["memory", "--model", f"gen={pair['gen']}", "--model", f"prm={pair['prm']}", "--dtype", "float32",
                 "--device", "cpu", "--cpu-kv-memory-fraction", "0.0625", "--max-model-len", "128"]) == 0
    assert "KV budget 16.0 MiB" in capsys.readouterr().out


def test_runtime_takes_the_vllm_arguments_llm_takes(pair):
    """The README: a Runtime takes the engine arguments `LLM(...)` takes; vLLM's `trust_remote_code=True`,
    which LLM takes (no model code is loaded from a checkpoint), was a ParamError here."""
    rt = _runtime(pair, trust_remote_code=True, kv_cache_dtype="auto", disable_log_stats=True)
    params = SamplingParams(temperature=0, max_tokens=3)
    assert len(rt.generate("gen", [QUESTION], params)[0].outputs[0].token_ids) == 3
    rt.close()


def test_unknown_model_name(pair):
    rt = _runtime(pair)
    with pytest.raises(ValueError, match="^model:"):
        rt.score_steps("verifier", QUESTION, ["a"])


def test_direct_scoring_refuses_a_conversation_too_long_for_the_verifier(pair):
    rt = _runtime(pair)
    with pytest.raises(ValueError, match="maximum model length 192"):
        rt.score_steps("prm", QUESTION, ["seven " * 200])
    assert len(rt.score_steps("prm", QUESTION, ["seven"])) == 1


def test_a_runtime_let_go_of_is_freed_at_once_without_the_garbage_collector(pair, tmp_path, monkeypatch):
    """`del rt` frees its engines, KV arena and weights and closes its trace as `del llm` does an LLM's,
    by reference counting alone (was: the engines and what they ran on sat in reference cycles, through
    their reclaim callbacks, until a collection, and making a new Runtime collected first: ~0.25 s each).
    An explicit close() is not repeated when it goes."""
    from treeserve.engine.llm_engine import LLMEngine

    rt = _runtime(pair, trace_path=tmp_path / "trace.jsonl")
    rt.generate("gen", ["seven"], SamplingParams(max_tokens=2))
    assert len(rt.score_steps("prm", QUESTION, ["seven"])) == 1
    engines, trace, alive = [weakref.ref(e) for e in rt.engines.values()], rt.trace, weakref.ref(rt)
    held = [rt.engines["gen"].runner.arena.pages]
    held += [w for e in rt.engines.values() for w in e.model.parameters() if w.untyped_storage().resizable()]
    gc.disable()  # (no collection may run: the last reference going frees it all)
    try:
        del rt
        assert alive() is None and [e() for e in engines] == [None, None], "left for the garbage collector"
        assert all(tensor.untyped_storage().nbytes() == 0 for tensor in held)
        assert trace._file.closed
    finally:
        gc.enable()
    closed = []
    monkeypatch.setattr(LLMEngine, "close", lambda engine: closed.append(engine))
    rt = _runtime(pair)
    rt.close()
    assert len(closed) == 2
    del rt
    gc.collect()
    assert len(closed) == 2


def test_an_engine_held_after_its_runtime_is_let_go_of_keeps_working_until_it_is_let_go_of_too(pair):
    """`eng = Runtime(...).engine("gen")`, or a scorer so taken: the Runtime, dropped at once, was closed
    and closed the engine its caller still held (EngineClosedError at its first request), freeing the
    arena and weights under it. An engine keeps what it runs on while it is referenced, as an LLM's
    engine does after `del llm` (vLLM's too); let go of in turn, all of it is freed at once."""
    from treeserve import LLM

    gc.disable()  # (no collection may run: reference counting alone keeps and frees)
    try:
        engine = _runtime(pair).engine("gen")
        scorer = _runtime(pair, kv_mode="static").scorer("prm")
        greedy = SamplingParams(max_tokens=3, temperature=0.0)
        assert len(LLM.from_engine(engine).generate(["Hello"], greedy, use_tqdm=False)[0].outputs[0].token_ids) == 3
        assert len(scorer.score_many([(QUESTION, ["seven", "eight"])])[0]) == 2
        held = [engine.runner.arena.pages, scorer.engine.runner.arena.pages]
        held += [w for e in (engine, scorer.engine) for w in e.model.parameters() if w.untyped_storage().resizable()]
        assert all(tensor.untyped_storage().nbytes() > 0 for tensor in held)
        del engine, scorer
        assert all(tensor.untyped_storage().nbytes() == 0 for tensor in held), "let go of, their memory was kept"
    finally:
        gc.enable()


def test_a_model_let_go_of_beside_one_still_held_gives_the_shared_pool_back_its_kept_blocks(pair):
    """`gen = rt.engine("gen"); del rt`: the verifier, let go of, goes; the conversations its scorer kept
    in the shared pool must not stay pinned there for the generator that serves on."""
    from treeserve import LLM

    rt = _runtime(pair)
    rt.score_steps("prm", QUESTION, ["seven", "eight"])
    engine, pool = rt.engine("gen"), rt.engines["gen"].kv.pool
    assert pool.num_in_use_by("prm") > 0  # (the scorer keeps its conversations)
    prm = weakref.ref(rt.engines["prm"])
    del rt
    assert prm() is None
    assert pool.num_in_use_by("prm") == 0, "the verifier let go of kept its blocks"
    out = LLM.from_engine(engine).generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert_no_leak(engine)


@pytest.mark.parametrize("dropped_on", ["another thread", "the stepping thread, by the collector"])
def test_a_model_let_go_of_while_another_steps_gives_its_blocks_back_as_that_step_ends(pair, dropped_on):
    """`gen = rt.engine("gen"); del rt` while gen steps on a thread of its own: the verifier's last
    reference went on another thread (or in a collection the garbage collector ran inside gen's step),
    and its blocks went back to the shared pool there and then, under the step reading and changing the
    pool (its free queue mid-allocation, `stalled_owners` mid-iteration). They go back as the step ends."""
    rt = _runtime(pair)
    rt.score_steps("prm", QUESTION, ["seven", "eight"])
    engine, pool = rt.engine("gen"), rt.engines["gen"].kv.pool
    holder = {"prm": rt.engines["prm"]}
    collected = dropped_on != "another thread"
    if collected:
        holder["itself"] = holder  # (a cycle: only a collection frees it)
    del rt
    assert pool.num_in_use_by("prm") > 0
    in_step, dropped, seen = threading.Event(), threading.Event(), []

    def mid_step(module, args):  # (inside gen's forward)
        if not seen:
            in_step.set()
            assert dropped.wait(30)
            if collected:
                gc.collect()
            seen.append(pool.num_in_use_by("prm"))

    engine.model.layers[-1].register_forward_pre_hook(mid_step)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))

    def run() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    stepper = threading.Thread(target=run)
    gc.disable()  # (no collection but the one in the step)
    try:
        stepper.start()
        assert in_step.wait(30)
        del holder  # (the verifier goes here, on this thread, unless a cycle keeps it for the collection)
        dropped.set()
        stepper.join(30)
    finally:
        gc.enable()
    assert seen and seen[0] > 0, "the verifier's blocks went back to the pool mid-step"
    assert pool.num_in_use_by("prm") == 0, "the verifier let go of kept its blocks"
    assert not engine.has_unfinished_requests()
    assert_no_leak(engine)


def test_a_model_loaded_after_a_runtime_is_let_go_of_measures_the_memory_it_freed(pair, monkeypatch):
    """`del rt`, then `LLM(...)`: the LLM measured the memory left for its KV with the dropped Runtime's
    arena and weights still in use (on CUDA, a gpu_memory_utilization budget finding none left) while
    they waited for the garbage collector; `del rt` frees them at once (runtime/parts.py)."""
    from treeserve import LLM
    from treeserve.engine import memory

    rt = _runtime(pair)
    rt.generate("gen", ["Hello"], SamplingParams(max_tokens=2))
    pages = rt.engines["gen"].runner.arena.pages
    held_when_measured = []
    monkeypatch.setattr(memory, "available_host_bytes",  # (what the LLM's default KV budget reads)
                        lambda: held_when_measured.append(pages.untyped_storage().nbytes()) or 64 << 20)
    gc.disable()  # (no collection runs: the outcome does not hang on when one comes)
    try:
        del rt
        llm = LLM(str(pair["gen"]), dtype="float32", device="cpu", max_model_len=192)
    finally:
        gc.enable()
    llm.close()
    assert held_when_measured == [0], "the LLM measured the memory left with the dropped Runtime's arena held"


def test_a_runtime_let_go_of_within_a_reference_cycle_is_freed_by_the_collection_that_finds_it(pair):
    """A Runtime that a cycle holds (a server app's state does) goes with its memory in one collection."""
    rt = _runtime(pair)
    pages = rt.engines["gen"].runner.arena.pages
    holder = {"runtime": rt}
    holder["itself"] = holder
    del rt, holder
    gc.collect()
    assert pages.untyped_storage().nbytes() == 0


def test_direct_scoring_strips_steps_as_the_server_does(pair):
    """Runtime.score_steps strips each step, as the server's /v1/rewards and /v1/score (and a search's
    split) do (was: " seven\n" scored as another step than "seven" offline, the same over HTTP;
    tests/test_server_multi_model.py checks offline against served scores)."""
    rt = _runtime(pair)
    clean = rt.score_steps("prm", QUESTION, ["seven", "eight"])
    assert rt.score_steps("prm", QUESTION, ["  seven\n\n", "\teight "]) == pytest.approx(clean, abs=1e-6)
    assert rt.score_many("prm", [(QUESTION, [" seven", "eight\n"])]) == [pytest.approx(clean, abs=1e-6)]


def test_direct_scoring_refuses_an_empty_step_as_the_server_does(pair):
    """Runtime.score_steps scored an empty or blank step (a score of nothing) where the server's
    /v1/rewards and /v1/score answer a 400 naming it."""
    rt = _runtime(pair)
    for steps, param in ((["seven", ""], "steps[1]"), ([" \n", "seven"], "steps[0]")):
        with pytest.raises(ValueError, match=rf"^{re.escape(param)}: a step is empty"):
            rt.score_steps("prm", QUESTION, steps)
        with pytest.raises(ValueError, match=rf"^items\[1\]\.{re.escape(param)}: a step is empty"):
            rt.score_many("prm", [(QUESTION, ["seven"]), (QUESTION, steps)])
    assert len(rt.score_steps("prm", QUESTION, ["seven", "eight"])) == 2


def test_direct_scoring_refuses_an_empty_question_as_the_server_does(pair):
    """Runtime.score_many scored an empty or blank question (the step scores of an answer to no
    question) where the server's /score, /v1/score, /v1/rewards and /pooling answer a 400 naming it."""
    rt = _runtime(pair)
    for question in ("", " \n\t"):
        with pytest.raises(ValueError, match=r"^question: the question is empty$"):
            rt.score_steps("prm", question, ["seven"])
        with pytest.raises(ValueError, match=r"^items\[1\]\.question: the question is empty$"):
            rt.score_many("prm", [(QUESTION, ["seven"]), (question, ["seven"])])
    assert len(rt.score_many("prm", [(QUESTION, ["seven"])])[0]) == 1



def test_direct_scoring_names_a_question_or_steps_of_the_wrong_type(pair):
    """A question that is no string raised AttributeError ('int' object has no attribute 'strip'), and
    steps given as one string were scored as one step a character: each is a ValueError naming it."""
    rt = _runtime(pair)
    with pytest.raises(ValueError, match=r"^question: must be a string, got int$"):
        rt.score_steps("prm", 7, ["seven"])
    with pytest.raises(ValueError, match=r"^steps: must be a list of strings, got str$"):
        rt.score_steps("prm", QUESTION, "seven")
    with pytest.raises(ValueError, match=r"^items\[0\]\.steps\[1\]: must be a string, got NoneType$"):
        rt.score_many("prm", [(QUESTION, ["seven", None])])
    assert len(rt.score_steps("prm", QUESTION, ("seven", "eight"))) == 2


def test_direct_scoring_names_an_item_that_is_not_a_pair(pair):
    """An item of score_many that is no (question, steps) pair raised Python's unpacking error ("not enough
    values to unpack", "cannot unpack non-iterable NoneType object"), naming no item: a ValueError naming it."""
    rt = _runtime(pair)
    for item, got in [(QUESTION, "str"), (None, "NoneType"), ((QUESTION,), "a tuple of 1"),
                      ([QUESTION, ["seven"], "extra"], "a list of 3"), ({"q": 1, "s": 2}, "dict")]:
        with pytest.raises(ValueError, match=rf"^items\[1\]: must be a \(question, steps\) pair, got {got}$"):
            rt.score_many("prm", [(QUESTION, ["seven"]), item])
    assert len(rt.score_many("prm", [[QUESTION, ["seven"]]])[0]) == 1


def test_memory_command(pair, capsys):
    from treeserve.cli import main

    assert main(["memory", "--model", f"gen={pair['gen']}", "--model", f"prm={pair['prm']}", "--dtype", "float32",
                 "--device", "cpu", "--kv-cache-memory-bytes", str(4 << 20), "--max-model-len", "128"]) == 0
    out = capsys.readouterr().out
    assert "weights" in out and "activations" in out and "gen" in out and "prm" in out


def test_direct_scoring_renders_each_input_once(pair, monkeypatch):
    """`score_many` checks that every input fits, then submits it: one rendering serves both."""
    rt = _runtime(pair)
    recipe = rt.scorer("prm").recipe
    built = []
    original = type(recipe).render  # (what writing an input costs: `build` and `build_many` both render)
    monkeypatch.setattr(type(recipe), "render", lambda self, tok, q, steps: built.append(len(steps)) or
                        original(self, tok, q, steps))
    items = [(QUESTION, ["First add.", "Then double."]), (QUESTION, ["First add.", "Then halve."])]
    scores = rt.score_many("prm", items)
    assert built == [2, 2] and [len(s) for s in scores] == [2, 2]


def test_runtimes_over_loaded_models_share_their_weights_and_reset_to_nothing_cached(pair):
    """Runtimes built one after another over the same loaded models (a benchmark's configurations)
    read the same weights; `reset_prefix_cache` leaves nothing cached, so a run repeated after it
    computes every token again and gives the same results."""
    from treeserve.config import EngineConfig
    from treeserve.engine.loaded_model import load_model

    options = dict(dtype="float32", device="cpu", max_model_len=192, max_num_batched_tokens=192)
    loaded = {name: load_model(EngineConfig(model=str(path), **options), name) for name, path in pair.items()}
    shared = Runtime(loaded, kv_cache_memory_bytes=8 << 20)
    static = Runtime(loaded, kv_mode="static", kv_fractions={"gen": 0.4, "prm": 0.6}, kv_cache_memory_bytes=8 << 20)
    assert shared.engines["prm"].model is static.engines["prm"].model is loaded["prm"].model
    assert shared.recipes == _runtime(pair).recipes
    first = _search_like(shared)
    computed = {name: e.num_tokens_computed for name, e in shared.engines.items()}
    again_cached = _search_like(shared)
    assert again_cached == first
    assert shared.engines["prm"].num_tokens_computed - computed["prm"] < computed["prm"]  # it hit its caches
    assert shared.reset_prefix_cache()
    assert shared.engines["gen"].stats(count_cached=True).kv_blocks_cached == 0
    assert shared.engines["gen"].stats().thrash_window_size == 0
    before = {name: e.num_tokens_computed for name, e in shared.engines.items()}
    assert _search_like(shared) == first
    assert {name: e.num_tokens_computed - before[name] for name, e in shared.engines.items()} == computed
    assert [c for c, _ in _search_like(static)] == [c for c, _ in first]
    shared.close()
    static.close()


def test_a_runtime_over_given_loaded_models_takes_its_engine_options(pair):
    """Engine options (scheduler, KV cache) given to a Runtime over models passed in loaded apply to
    its engines (they were silently dropped: the engines ran on the options the models were loaded
    with); the caller's loaded models keep theirs."""
    from treeserve.config import EngineConfig
    from treeserve.engine.loaded_model import load_model

    options = dict(dtype="float32", device="cpu", max_model_len=192, max_num_batched_tokens=192)
    loaded = {name: load_model(EngineConfig(model=str(path), **options), name) for name, path in pair.items()}
    rt = Runtime(loaded, kv_mode="static", kv_fractions={"gen": 0.5, "prm": 0.5}, kv_cache_memory_bytes=8 << 20,
                 max_num_seqs=3, block_size=32, max_num_batched_tokens=96, enable_prefix_caching=False,
                 max_model_len=128, dtype="float32", device="cpu")
    try:
        for engine in rt.engines.values():
            assert engine.scheduler.max_num_seqs == 3
            assert engine.stats().block_size == engine.kv.block_size == 32
            assert engine.scheduler.max_num_batched_tokens == engine.max_num_batched_tokens == 96
            assert engine.kv.pool.enable_caching is False
            assert engine.max_model_len == 128
        assert rt.generate("gen", ["Hello"], SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].token_ids
    finally:
        rt.close()
    assert all(m.config.max_num_seqs == 256 and m.config.block_size == 16 and m.max_model_len == 192
               for m in loaded.values())


@pytest.mark.parametrize("option, value", [("dtype", "bfloat16"), ("max_model_len", 256), ("seed", 7),
                                           ("tensor_parallel_size", 2), ("load_format", "dummy")])
def test_a_runtime_over_given_loaded_models_refuses_a_load_option_they_were_not_loaded_with(pair, option, value):
    from treeserve.config import EngineConfig
    from treeserve.engine.loaded_model import load_model

    options = dict(dtype="float32", device="cpu", max_model_len=192, max_num_batched_tokens=192)
    loaded = {"gen": load_model(EngineConfig(model=str(pair["gen"]), **options), "gen")}
    with pytest.raises(ParamError, match="fixed when the model was loaded") as err:
        Runtime(loaded, kv_cache_memory_bytes=8 << 20, **{option: value})
    assert err.value.param == option


def test_every_engine_option_is_either_an_engines_or_fixed_at_load():
    import dataclasses

    from treeserve.config import EngineConfig
    from treeserve.engine.loaded_options import ENGINE_OPTIONS, LOAD_OPTIONS

    names = [f.name for f in dataclasses.fields(EngineConfig)]
    assert sorted(ENGINE_OPTIONS + LOAD_OPTIONS) == sorted(names)


def test_a_model_waits_for_the_blocks_another_models_running_requests_hold(pair):
    """Shared arena: a verifier request that arrives while the generator's running sequences hold the
    whole pool waits a few steps for them to end, then runs, before any generator request that came
    after it (it used to fail the engine loop with
    "KV pool exhausted" although the generator was about to free the blocks: a search in a shared
    arena of 8 or 16 MiB on the bundled pair died so)."""
    from treeserve.engine.engine_loop import EngineLoop

    probe = _runtime(pair)
    page = probe.engines["gen"].kv.block_size * probe.engines["gen"].kv_bytes_per_token()
    # (stripped, as Runtime.score_many reads them: the scorer's own submit takes steps as given)
    steps = [("step one is here and it is long " * 4).strip(), ("two " * 10).strip()]
    expected = probe.score_many("prm", [(QUESTION, steps)])
    rt = Runtime(pair, dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=128,
                 kv_cache_memory_bytes=24 * page)
    gen, loop, stalled, done = rt.engines["gen"], EngineLoop.of(rt.engines), [], []
    loop.step_observers.append(lambda engine, outputs: stalled.append(engine.name) if engine.is_stalled else None)
    for i in range(6):  # sequences of different lengths: they end, and free their blocks, one by one
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=40 + 8 * i, ignore_eos=True)
        loop.add_request(gen, f"g{i}", gen.tokenizer.encode(QUESTION), params,
                         lambda o: done.append(o) if o.finished else None)
    while gen.kv.pool.num_free > 3:  # the generator's sequences grow until they hold the pool
        assert loop.step(), "the generator ended before it held the pool"
    ticket = rt.scorer("prm").submit([(QUESTION, steps)])
    loop.step()
    assert rt.engines["prm"].is_stalled
    # meanwhile the generator admits nothing new: the blocks its sequences free go to the verifier
    later_ran_before_the_verifier = []
    loop.step_observers.append(lambda engine, outputs: later_ran_before_the_verifier.append(not ticket.ready) if any(
        r.request_id.startswith("later") for r in gen.scheduler.running) else None)
    loop.add_request(gen, "later", gen.tokenizer.encode(QUESTION), SamplingParams(max_tokens=4, ignore_eos=True),
                     lambda o: None)
    loop.run_until(lambda: ticket.ready and not loop.has_unfinished_requests())
    assert "prm" in stalled and "gen" not in stalled  # the verifier waited, then ran
    assert later_ran_before_the_verifier and not any(later_ran_before_the_verifier)
    assert ticket.results()[0] == pytest.approx(expected[0], abs=1e-5)
    assert sorted(len(o.outputs[0].token_ids) for o in done) == [40 + 8 * i for i in range(6)]
    rt.release_kept()
    for engine in rt.engines.values():
        assert_no_leak(engine)
