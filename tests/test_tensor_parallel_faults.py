"""A tensor-parallel worker that dies: a server idling on it turns /health 503 naming the rank;
`treeserve serve --tensor-parallel-size 2` exits and leaves no process behind; one that dies while
the engine starts (killed at spawn, failing its imports, killed in the rendezvous) fails the start
at once naming its rank and the cause, and the next engine in the process starts."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from conftest import API_KEY, _free_port, running_server
from test_server_tensor_parallel import TP_OPTIONS


def test_a_dead_worker_turns_health_503(llama_dir):
    from treeserve.server.launch import build_app

    app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], **TP_OPTIONS)
    engine = app.state.engine.engine
    try:
        with running_server(app) as url:
            assert httpx.get(f"{url}/health").status_code == 200
            os.kill(engine.executor.pids()[0], signal.SIGKILL)
            deadline, status = time.monotonic() + 10, 200
            while status == 200 and time.monotonic() < deadline:
                time.sleep(0.2)
                status = httpx.get(f"{url}/health").status_code
            body = httpx.get(f"{url}/health").json()
            assert status == 503 and "rank 1" in body["error"]["message"]
    finally:
        engine.close()


def test_requests_in_flight_when_a_worker_dies_get_a_503_naming_the_rank(llama_dir):
    """A whole reply and a stream running when a rank dies each end with 503 `engine_dead` naming the
    rank (was: a bare "internal error: RuntimeError" and "the reply failed part way")."""
    from treeserve.server.launch import build_app

    app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], **TP_OPTIONS)
    engine = app.state.engine.engine
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 400, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        with running_server(app) as url:
            whole: list = []
            waiting = threading.Thread(target=lambda: whole.append(
                httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)))
            waiting.start()
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                              headers=headers, timeout=60) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                os.kill(engine.executor.pids()[0], signal.SIGKILL)
                events = [line for line in lines if line.startswith("data: ")]
            waiting.join(30)
        last_event = json.loads(events[-2].removeprefix("data: "))["error"]
        assert events[-1] == "data: [DONE]" and last_event["code"] == "engine_dead"
        assert "rank 1 died" in last_event["message"]
        reply = whole[0]
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "engine_dead"
        assert "rank 1 died" in reply.json()["error"]["message"]
    finally:
        engine.close()


def test_the_served_command_exits_when_a_worker_dies_and_leaves_nothing(llama_dir):
    port = _free_port()
    command = [sys.executable, "-m", "treeserve.cli", "serve", str(llama_dir), "--port", str(port),
               "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", str(32 << 20),
               "--max-model-len", "512", "--tensor-parallel-size", "2", "--threads-per-rank", "1"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        workers = psutil.Process(server.pid).children(recursive=True)
        ranks = [p for p in workers if "tp_worker" in " ".join(p.cmdline()) or "spawn" in " ".join(p.cmdline())]
        assert ranks, f"no worker process under the server: {[p.cmdline() for p in workers]}"
        ranks[0].kill()
        code = server.wait(timeout=15)
        assert code != 0
        assert "rank 1" in server.stdout.read()
        time.sleep(1)
        assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


# Starting: a worker that dies before or during the rendezvous fails rank 0 within 10 s, naming the
# rank and the cause, leaves no process behind, and the next engine in this process starts.
START_OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, tensor_parallel_size=2,
                     threads_per_rank=1)
GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


def _spawned_workers() -> list[psutil.Process]:
    """This process's tensor-parallel workers (multiprocessing's spawned children)."""
    found = []
    for child in psutil.Process().children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return found


def _kill_the_first_worker(killed: list) -> threading.Thread:
    """Kills the first worker the moment it is spawned (long before it imports PyTorch), from a thread,
    and appends (process, when) to `killed`."""
    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            workers = _spawned_workers()
            if workers:
                workers[0].kill()
                killed.append((workers[0], time.monotonic()))
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _assert_gone(processes) -> None:
    time.sleep(0.5)
    assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_worker_killed_at_spawn_fails_the_start_at_once_naming_its_rank(llama_dir):
    from treeserve import LLM
    from treeserve.engine.tp_executor import WorkerDiedError

    killed = []
    watcher = _kill_the_first_worker(killed)
    with pytest.raises(WorkerDiedError, match="rank 1 died while starting.*SIGKILL") as failure:
        LLM(str(llama_dir), **START_OPTIONS)
    took = time.monotonic() - killed[0][1]
    watcher.join()
    print(f"failed {took:.2f} s after the kill: {failure.value}")
    assert failure.value.rank == 1 and took < 10
    _assert_gone([killed[0][0]] + _spawned_workers())


def test_a_worker_whose_imports_fail_names_the_cause_and_the_next_engine_starts(llama_dir, monkeypatch):
    """TORCH_LOGS is read when PyTorch is imported: this process has imported it already, the spawned
    worker imports it afresh and fails, as with any environment a worker cannot start in."""
    from treeserve import LLM, SamplingParams
    from treeserve.engine.tp_executor import WorkerDiedError

    with LLM(str(llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20) as one_rank:
        expected = one_rank.generate(["The water is"], SamplingParams(**GREEDY), use_tqdm=False)
    monkeypatch.setenv("TORCH_LOGS", "no-such-log")
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 failed while starting: ValueError: .*no-such-log") as failure:
        LLM(str(llama_dir), **START_OPTIONS)
    took = time.monotonic() - start
    print(f"failed {took:.2f} s after the start: {failure.value}")
    assert took < 10
    _assert_gone(_spawned_workers())
    monkeypatch.delenv("TORCH_LOGS")
    with LLM(str(llama_dir), **START_OPTIONS) as llm:
        outputs = llm.generate(["The water is"], SamplingParams(**GREEDY), use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_a_worker_killed_in_the_rendezvous_fails_the_start_at_once_and_the_next_engine_starts(llama_dir, monkeypatch):
    """The worker has reached the store and is joining the group: SIGKILL it right as rank 0 joins
    too (the patch only picks that moment). gloo alone gives up on the dead peer after five times
    its timeout, which is shortened here so that the next engine, which waits for that, starts sooner."""
    from treeserve import LLM, SamplingParams
    from treeserve.engine import tp_executor

    join, killed = tp_executor.init_distributed, []

    def kill_then_join(*args, **kwargs):
        worker = _spawned_workers()[0]
        worker.kill()
        killed.append((worker, time.monotonic()))
        return join(*args, **kwargs)

    monkeypatch.setattr(tp_executor, "init_distributed", kill_then_join)
    monkeypatch.setattr(tp_executor, "RENDEZVOUS_TIMEOUT_S", 2.0)
    with pytest.raises(tp_executor.WorkerDiedError, match="rank 1 died.*SIGKILL") as failure:
        LLM(str(llama_dir), **START_OPTIONS)
    took = time.monotonic() - killed[0][1]
    print(f"failed {took:.2f} s after the kill: {failure.value}")
    assert failure.value.rank == 1 and took < 10
    _assert_gone([killed[0][0]])
    monkeypatch.undo()
    with LLM(str(llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20) as one_rank:
        expected = one_rank.generate(["The water is"], SamplingParams(**GREEDY), use_tqdm=False)
    with LLM(str(llama_dir), **START_OPTIONS) as llm:
        outputs = llm.generate(["The water is"], SamplingParams(**GREEDY), use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_engines_one_after_another_in_one_process(llama_dir):
    """close() (or leaving `with`), then a new engine: the same tokens; two at once: a clear error."""
    from treeserve import LLM, SamplingParams
    from treeserve.errors import ParamError

    prompts, params = ["The water is", "Step 1: add"], SamplingParams(**GREEDY)
    first = LLM(str(llama_dir), **START_OPTIONS)
    workers = first.engine.executor.pids()
    tokens = [o.outputs[0].token_ids for o in first.generate(prompts, params, use_tqdm=False)]
    with pytest.raises(ParamError, match="already runs a tensor-parallel engine"):
        LLM(str(llama_dir), **START_OPTIONS)
    first.close()
    _assert_gone([psutil.Process(pid) for pid in workers if psutil.pid_exists(pid)])
    with LLM(str(llama_dir), **START_OPTIONS) as second:
        assert [o.outputs[0].token_ids for o in second.generate(prompts, params, use_tqdm=False)] == tokens
    assert not _spawned_workers()


def test_an_llm_let_go_of_stops_its_workers(llama_dir):
    """`del llm` (vLLM's way of freeing an engine) stops its workers and leaves the process free for
    the next tensor-parallel engine (was: the workers ran on, and the next LLM was refused). So does
    `del rt`, by reference counting alone (a Runtime's engines sat in reference cycles, its workers
    waited for the garbage collector, and the next LLM was refused: "this process already runs a
    tensor-parallel engine"; runtime/parts.py)."""
    import gc

    import torch.distributed as dist

    from treeserve import LLM, Runtime, SamplingParams

    gc.disable()  # (no collection may run: the Runtime's last reference going stops its workers)
    try:
        rt = Runtime({"gen": str(llama_dir)}, **START_OPTIONS)
        expected = rt.generate("gen", ["Hello"], SamplingParams(**GREEDY))[0].outputs[0].token_ids
        workers = [psutil.Process(pid) for pid in rt.executor.pids()]
        del rt
        assert not [p for p in workers if p.is_running()]  # (stopped and reaped as it went: no wait)
        llm = LLM(str(llama_dir), **START_OPTIONS)
    finally:
        gc.enable()
    assert llm.generate("Hello", SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids == expected
    workers = [psutil.Process(pid) for pid in llm.engine.executor.pids()]
    del llm
    gc.collect()
    _assert_gone(workers)
    assert not dist.is_initialized()


def test_rank_0_keeps_the_scripts_own_traceback_hook(llama_dir):
    """A script's own tracebacks read as before (was: torch's hook put "[rank0]: " before each line,
    once more for each engine the script had started)."""
    from treeserve import LLM

    hook = sys.excepthook
    with LLM(str(llama_dir), **START_OPTIONS):
        assert sys.excepthook is hook


def test_more_ranks_than_gpus_is_a_clear_error_before_any_worker_starts(monkeypatch):
    """tensor_parallel_size 2 on a machine with one GPU: a ParamError naming both numbers, and no
    process started (was: a worker spawned for a GPU that is not there, failing in it)."""
    import torch

    from treeserve.engine.tp_executor import TPExecutor
    from treeserve.engine.tp_start import worker_process
    from treeserve.errors import ParamError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ParamError, match=r"2 ranks need 2 GPUs from cuda:0 on, and this machine has 1"):
        TPExecutor(2, torch.device("cuda:0"), 1, entry=worker_process)
    assert not _spawned_workers()


def _cmdline(process: psutil.Process) -> str:
    """A child's command line; "" for one that has ended (a zombie not yet reaped, or gone)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_a_serve_start_cut_short_by_sigterm_exits_143_and_leaves_nothing(llama_dir):
    """SIGTERM while `treeserve serve --tensor-parallel-size 2` starts (rank 1 held stopped, so the
    start cannot finish first): exit 128 + 15, as a start cut short is no success (was: 0, what a
    served process stopped by SIGTERM exits with), and no process left behind."""
    command = [sys.executable, "-m", "treeserve.cli", "serve", str(llama_dir), "--port", str(_free_port()),
               "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", str(8 << 20),
               "--tensor-parallel-size", "2", "--threads-per-rank", "1"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, ranks = time.monotonic() + 120, []
        while not ranks and server.poll() is None and time.monotonic() < deadline:
            ranks = [p for p in psutil.Process(server.pid).children() if "spawn_main" in _cmdline(p)]
            time.sleep(0.01)
        assert ranks, f"no rank started: {server.poll()}"
        family = psutil.Process(server.pid).children(recursive=True)
        ranks[0].suspend()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 128 + signal.SIGTERM, server.stdout.read()[-3000:]
        assert "SIGTERM: stopping" in server.stdout.read()
        _assert_gone(family)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
