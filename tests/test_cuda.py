"""The CUDA path: the same engine on a GPU agrees with the CPU run (skipped without a GPU).
Logits and greedy tokens against HF on the GPU are in test_hf_parity (it runs on every device)."""
import pytest
import torch

from conftest import assert_no_leak
from treeserve import LLM, Runtime, SamplingParams
from treeserve.model.attention import TorchSDPABackend
from treeserve.search.config import SearchConfig
from treeserve.search.runner import SearchRunner
from treeserve.testing.tiny_models import FAMILIES, make_tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="hardware: no CUDA device")


def test_backend_imports_and_is_device_agnostic():
    assert TorchSDPABackend.name == "torch_sdpa"


@cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_greedy_matches_cpu(tiny_model_dirs, family):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["Hello there", "The water is", "café 日本語 😀"]
    path = str(tiny_model_dirs[family])
    cpu = LLM(path, dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20).generate(prompts, params)
    llm = LLM(path, dtype="float32", device="cuda", kv_cache_memory_bytes=8 << 20)
    gpu = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in cpu] == [o.outputs[0].token_ids for o in gpu]
    assert_no_leak(llm.engine)


@cuda
def test_bfloat16_on_cuda_generates_the_same_tokens_for_the_same_prompt_in_a_batch(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="bfloat16", device="cuda", kv_cache_memory_bytes=8 << 20)
    assert llm.engine.dtype == torch.bfloat16
    out = llm.generate(["The water is"] * 3, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len({tuple(o.outputs[0].token_ids) for o in out}) == 1


@cuda
def test_search_on_cuda_in_a_tight_shared_arena_matches_the_cpu(tmp_path):
    steps = {"\n": 5.4, "<|eos|>": 0.5}
    pair = {"gen": make_tiny_model("llama", tmp_path / "gen", seed=5, favour_tokens=steps),
            "prm": make_tiny_model("qwen2", tmp_path / "prm", seed=6, hidden_size=96, num_hidden_layers=3,
                                   prm_recipe="rlhflow")}
    config = SearchConfig(strategy="beam", n=4, beam_width=2, num_iterations=3, max_tokens=24, temperature=1.0,
                          system_prompt="Solve it.", seed=3)
    questions = ["What is 2 + 3?", "Double seven, then add one.", "How many sides has a square?"]

    def search(device, kv_bytes):
        rt = Runtime(pair, dtype="float32", device=device, max_model_len=384, max_num_batched_tokens=384,
                     kv_cache_memory_bytes=kv_bytes)
        results = SearchRunner(rt.engine("gen"), rt.scorer("prm")).run(questions, config)
        rt.release_kept()
        for engine in rt.engines.values():
            assert_no_leak(engine)
        return results

    cpu, gpu = search("cpu", 8 << 20), search("cuda", 1 << 20)
    assert [r.completions for r in gpu] == [r.completions for r in cpu]
    for x, y in zip(gpu, cpu):
        assert x.chosen == y.chosen
        for a, b in zip(x.scores, y.scores):
            assert a == pytest.approx(b, abs=1e-4)


@cuda
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_async_scheduling_on_cuda_gives_the_synchronous_outputs(tiny_model_dirs, family):
    """On the device the next step's inputs take the sampled ids behind the running step on the
    stream (CUDA graphs replayed for its decode steps): the outputs equal a synchronous engine's."""
    from test_async_output import PROMPTS, _params
    from test_async_scheduling import _assert_same

    path, options = str(tiny_model_dirs[family]), dict(dtype="float32", device="cuda", kv_cache_memory_bytes=8 << 20)
    sync = LLM(path, async_scheduling=False, **options)
    overlapped = LLM(path, **options)
    assert overlapped.engine.pipeline.async_scheduling and overlapped.engine.runner.graphs is not None
    expected = sync.generate(PROMPTS, _params(), use_tqdm=False)
    _assert_same(overlapped.generate(PROMPTS, _params(), use_tqdm=False), expected)
    assert overlapped.engine.stats().num_steps_left_running > 0
    assert_no_leak(overlapped.engine)


@cuda
def test_a_step_is_launched_without_waiting_for_the_device(tiny_model_dirs):
    """`runner.launch` (inputs, forward, sampling, the start of the copy back) only queues work:
    nothing in it waits for the device, whatever the sampling asks (torch's sync debug mode warns
    at each call that synchronizes, e.g. a copy from pageable host memory)."""
    import warnings

    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", device="cuda", kv_cache_memory_bytes=8 << 20)
    runner, launch, syncs = llm.engine.runner, llm.engine.runner.launch, []

    def watched(step):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return launch(step)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                syncs.extend(f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "called a synchronizing" in str(w.message))

    runner.launch = watched
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logprobs=3, max_tokens=12),
              SamplingParams(temperature=1.0, min_tokens=4, logit_bias={5: 2.0}, max_tokens=12),
              SamplingParams(temperature=1.0, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=12)]
    outputs = llm.generate(["Hello there", "The water is", "One two", "Three", "Four five six"], params)
    assert all(o.outputs[0].token_ids for o in outputs)
    assert not syncs, "\n".join(dict.fromkeys(syncs))


@cuda
def test_staging_on_cuda_is_pinned_double_buffered_and_waits_for_its_copies():
    """A step's values through pinned host buffers used in turn: each step's device views hold its own
    values after the next steps rewrote the staging (a host buffer is rewritten only after its copy is
    done; the device buffer, in stream order), with a large kernel queued ahead of the copies."""
    from treeserve.model.transfer import StepStaging
    device = torch.device("cuda")
    staging = StepStaging(device)
    big = torch.randn(4096, 4096, device=device)
    kept = []
    for step in range(6):
        big = big @ big.T / 4096  # (keeps the stream busy while the host stages the next step)
        values = list(range(step * 100, step * 100 + 50))
        view = staging.stage(values, torch.long)
        table = staging.stage([[step] * 7] * 3, torch.int32, (3, 7))
        staging.flush()
        kept.append((values, view.clone(), table.clone()))  # (clones queued behind the copy: this step's values)
    assert all(buffer.hosts[0].is_pinned() and len(buffer.hosts) == 2 for buffer in staging._buffers.values())
    for step, (values, view, table) in enumerate(kept):
        assert view.tolist() == values and table.tolist() == [[step] * 7] * 3
    assert staging.num_copies == 12
