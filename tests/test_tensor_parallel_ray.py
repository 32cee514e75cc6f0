"""Tensor parallelism with its workers as Ray actors (`distributed_executor_backend="ray"`), on a
local Ray instance: the same tokens and logprobs as one rank, and every actor gone afterwards."""
import os
import subprocess
import sys

import pytest

from conftest import _free_port, assert_no_leak
from treeserve import LLM, SamplingParams

ray = pytest.importorskip("ray", reason="ray is not installed (it comes with the test extra: pip install -e '.[test]')")

OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=24)
PROMPTS = ["The water is", "A long time ago in a place far away there was one old man", "x"]


def test_two_ranks_over_ray_give_one_ranks_tokens(llama_dir):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    with LLM(str(llama_dir), **OPTIONS) as llm:
        ref = llm.generate(PROMPTS, params, use_tqdm=False)
    with LLM(str(llama_dir), **OPTIONS, tensor_parallel_size=2, threads_per_rank=1,
             distributed_executor_backend="ray") as llm:
        out = llm.generate(PROMPTS, params, use_tqdm=False)
        pids = llm.engine.executor.pids()
        assert pids and os.getpid() not in pids
        assert_no_leak(llm.engine)
    assert not ray.is_initialized(), "the Ray instance this engine started is shut down with it"
    for x, y in zip(out, ref):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for ex, ey in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert all(abs(ex[t].logprob - ey[t].logprob) < 1e-4 for t in ey)


def test_a_ray_address_nothing_answers_at_fails_the_start_at_once(llama_dir):
    """RAY_ADDRESS naming a cluster that is not running: exit 2 at once with the address and what to
    do (was: Ray retrying the address for minutes, the server neither up nor gone)."""
    address = f"127.0.0.1:{_free_port()}"
    command = [sys.executable, "-m", "treeserve.cli", "serve", str(llama_dir), "--device", "cpu",
               "--port", str(_free_port()), "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "RAY_ADDRESS": address})
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"still starting after 60 s: {exc.stderr}")
    assert done.returncode == 2
    assert f"no Ray cluster answers at RAY_ADDRESS={address}" in done.stderr + done.stdout


def test_without_ray_address_a_local_instance_starts_even_beside_a_running_cluster(llama_dir, monkeypatch):
    """No RAY_ADDRESS while `ray start` has left a cluster on this machine: the engine still starts a
    Ray instance of its own, as documented (was: Ray joined that cluster and refused the engine's
    num_cpus with a ValueError). The cluster here is a stale record, which Ray reads the same way."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths live under it
    os.makedirs(os.path.join(folder, "ray"))
    with open(os.path.join(folder, "ray", "ray_current_cluster"), "w") as record:
        record.write(f"127.0.0.1:{_free_port()}")
    monkeypatch.setenv("RAY_TMPDIR", folder)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        with LLM(str(llama_dir), **OPTIONS, tensor_parallel_size=2, threads_per_rank=1,
                 distributed_executor_backend="ray") as llm:
            assert llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
        assert not ray.is_initialized()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
