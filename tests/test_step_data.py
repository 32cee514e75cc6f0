"""The step as plain data: nothing below the scheduler sees a `Request` or the KV manager, a step
pickles (so it can go to another process), and the runner keeps its own view of the requests."""
import pickle

from conftest import assert_no_leak
from import_graph import chain, reached, source_modules
from treeserve import LLM, SamplingParams

ENGINE = "treeserve.engine"
# Where a step is executed: the runner, and the tensor-parallel modules (tp_*) that start the
# workers, carry a step to them in other processes and run it there. Below the scheduler is all
# they reach through their imports, transitively (a new module they import is covered unnamed).
STEP_CONSUMERS = sorted(m for m in source_modules()
                        if m == f"{ENGINE}.model_runner" or m.startswith(f"{ENGINE}.tp_"))
SCHEDULER_SIDE = {"treeserve.engine.request", "treeserve.engine.kv_cache_manager", "treeserve.engine.scheduler",
                  "treeserve.engine.step_builder", "treeserve.engine.llm_engine", "treeserve.engine.block_pool"}


def below_the_scheduler() -> dict[str, dict[str, str]]:
    """Step consumer -> each module it reaches, mapped to the module that imports it there."""
    return {consumer: reached(consumer) for consumer in STEP_CONSUMERS}


def test_nothing_below_the_scheduler_imports_requests_or_the_kv_manager():
    offenders = [consumer for consumer in STEP_CONSUMERS if consumer in SCHEDULER_SIDE]
    offenders += [chain(via, consumer, target) for consumer, via in below_the_scheduler().items()
                  for target in sorted(SCHEDULER_SIDE & set(via))]
    assert not offenders, "\n".join(offenders)


def test_the_check_sees_an_import_and_what_lies_below_the_runner():
    assert "treeserve.engine.request" in reached("treeserve.engine.step_builder")
    assert {f"{ENGINE}.{m}" for m in ("model_runner", "tp_worker", "tp_executor", "tp_ray")} <= set(STEP_CONSUMERS)
    below = set().union(*below_the_scheduler().values())
    assert {f"{ENGINE}.{m}" for m in ("sampler", "prompt_logprobs", "input_batch", "step_data", "cuda_graphs",
                                       "kv_arena")} <= below


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
