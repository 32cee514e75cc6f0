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


def test_more_ranks_than_the_ray_clusters_gpus_is_a_clear_error_at_once(monkeypatch):
    """CUDA ranks over a Ray cluster (here a local one declaring 1 GPU) that has fewer GPUs than ranks
    1..N-1 need: a ParamError naming both numbers before any actor starts (was: the placement group
    waited START_TIMEOUT_S, 120 s, for GPUs that were not there, then timed out)."""
    import torch

    from treeserve.engine import tp_ray
    from treeserve.errors import ParamError

    monkeypatch.setattr(tp_ray, "START_TIMEOUT_S", 15.0)  # (the old wait, cut short for this test)
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(ParamError, match=r"3 ranks over Ray need 2 GPUs in the Ray cluster, one for each of "
                                             r"ranks 1\.\.2 \(rank 0 runs here\), and it has 1; use at most 2"):
            tp_ray.RayTPExecutor(3, torch.device("cuda"), 1)
        assert not ray.util.placement_group_table()
    finally:
        ray.shutdown()


def test_a_local_ray_instance_counts_rank_0s_gpu_among_its_own():
    from treeserve.engine.tp_ray import check_ray_gpus
    from treeserve.errors import ParamError

    check_ray_gpus(2, 2, local=True)
    check_ray_gpus(1, 2, local=False)
    with pytest.raises(ParamError, match=r"2 ranks over Ray need 2 GPUs in the local Ray instance, which counts "
                                         r"rank 0's too, and it has 1; use at most 1"):
        check_ray_gpus(1, 2, local=True)
