"""The step as plain data: nothing below the scheduler sees a `Request` or the KV manager, a step
pickles (so it can go to another process), and the runner keeps its own view of the requests."""
import ast
import pickle
from pathlib import Path


from conftest import assert_no_leak
from treeserve import LLM, SamplingParams

ENGINE = Path(__file__).resolve().parents[1] / "src" / "treeserve" / "engine"
BELOW_THE_SCHEDULER = ["model_runner", "sampler", "prompt_logprobs", "input_batch", "step_data", "cuda_graphs",
                       "tp_worker", "tp_executor", "tp_ray"]
SCHEDULER_SIDE = {"treeserve.engine.request", "treeserve.engine.kv_cache_manager", "treeserve.engine.scheduler",
                  "treeserve.engine.step_builder", "treeserve.engine.llm_engine", "treeserve.engine.block_pool"}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_nothing_below_the_scheduler_imports_requests_or_the_kv_manager():
    offenders = {name: sorted(imported_modules(ENGINE / f"{name}.py") & SCHEDULER_SIDE) for name in BELOW_THE_SCHEDULER}
    assert not any(offenders.values()), offenders


def test_the_check_sees_an_import():
    assert "treeserve.engine.request" in imported_modules(ENGINE / "step_builder.py")


def test_steps_pickle_and_the_runner_keeps_only_what_it_serves(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    engine, steps = llm.engine, []
    build = engine.steps.build

    def recorded(sched):
        step = build(sched)
        steps.append(pickle.loads(pickle.dumps(step)))
        return step
    engine.steps.build = recorded
    out = llm.generate(["Hello there", "The water is"], [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                                         SamplingParams(temperature=0.8, seed=2, max_tokens=9, n=2)],
                       use_tqdm=False)
    assert [len(c.token_ids) for o in out for c in o.outputs] == [5, 9, 9]
    first, later = steps[0], steps[3]
    assert first.new_requests and not first.cached_requests
    assert later.cached_requests and all(len(c.new_token_ids) <= 1 for c in later.cached_requests)
    assert all(isinstance(t, int) for c in later.cached_requests for t in c.new_token_ids)
    earlier = set(engine.runner.batch.requests)
    llm.generate(["x"], SamplingParams(max_tokens=3), use_tqdm=False)  # its first step names the others finished
    assert earlier and not earlier & set(engine.runner.batch.requests)
    assert_no_leak(engine)


def test_a_preempted_request_comes_back_with_a_new_table_and_the_same_tokens(llama_dir):
    """Preempted (blocks freed, recomputed later), a request stays in the runner's batch (its seeded
    generator keeps its place) and its block table is resent from where it changed."""
    from treeserve.engine.model_runner import kv_bytes_per_block

    prompts = ["Hello there", "The water is", "A long time ago in a place far away there was", "x y z"]
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=40, ignore_eos=True) for i in range(4)]
    roomy = LLM(str(llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    per_block = kv_bytes_per_block(roomy.engine.model, 16, roomy.engine.dtype)
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=per_block * 8, max_model_len=128)
    engine, lengths, replaced = llm.engine, {}, []
    build = engine.steps.build

    def recorded(sched):
        step = build(sched)
        for new in step.new_requests:
            lengths[new.req_id] = len(new.block_ids)
        for cached in step.cached_requests:
            if cached.block_ids_from < lengths[cached.req_id]:
                replaced.append(cached.req_id)
            lengths[cached.req_id] = cached.block_ids_from + len(cached.new_block_ids)
        return step
    engine.steps.build = recorded
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert engine.scheduler.num_preemptions > 0 and replaced
    assert got == expected
    assert_no_leak(engine)
