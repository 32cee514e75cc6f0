"""The engine loop is the one owner that steps engines: nothing else calls `LLMEngine.step()`."""
import ast
import sys
from pathlib import Path

import pytest

from treeserve import LLM, Runtime, SamplingParams
from treeserve.engine.engine_loop import EngineLoop
from treeserve.engine.llm_engine import LLMEngine
from treeserve.search.config import SearchConfig
from treeserve.search.runner import SearchRunner

ROOT = Path(__file__).resolve().parents[1]
LOOP_FILE = ROOT / "src" / "treeserve" / "engine" / "engine_loop.py"
# `.step()` calls on receivers that are not our engines: a torch optimizer, an engine loop, and vLLM's
# own engine in the peer benchmark's worker (benchmarks/peer_worker.py, run in vLLM's virtualenv)
NOT_ENGINES = ("optimizer", "loop", "vllm_engine")


def _step_calls(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step" \
                and not node.args and not node.keywords:
            receiver = node.func.value
            name = receiver.id if isinstance(receiver, ast.Name) else getattr(receiver, "attr", "")
            if not name.endswith(NOT_ENGINES):
                lines.append(node.lineno)
    return lines


def test_only_the_engine_loop_calls_step_in_the_source():
    sources = [p for folder in ("src", "benchmarks", "scripts") for p in (ROOT / folder).rglob("*.py")]
    offenders = {str(p.relative_to(ROOT)): lines for p in sources if p != LOOP_FILE and (lines := _step_calls(p))}
    assert not offenders, f"engines stepped outside engine/engine_loop.py: {offenders}"
    assert _step_calls(LOOP_FILE), "the check must see the loop's own call"


@pytest.fixture
def steppers(monkeypatch):
    """Records the file of every caller of LLMEngine.step while a test runs."""
    callers = []
    step = LLMEngine.step

    def watched(self):
        callers.append(sys._getframe(1).f_code.co_filename)
        return step(self)
    monkeypatch.setattr(LLMEngine, "step", watched)
    return callers


def test_offline_generation_scoring_and_search_step_through_the_loop(tiny_model_dirs, steppers):
    options = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=256)
    LLM(str(tiny_model_dirs["llama"]), **options).generate(["Hello", "Hi"], SamplingParams(max_tokens=4),
                                                           use_tqdm=False)
    rt = Runtime({"gen": tiny_model_dirs["llama"], "prm": tiny_model_dirs["qwen2"]}, recipes={"prm": "rlhflow"},
                 **options)
    rt.generate("gen", "Count:", SamplingParams(max_tokens=3))
    rt.score_steps("prm", "What is one and one?", ["one and one is two."])
    config = SearchConfig(strategy="beam", n=4, beam_width=2, num_iterations=2, max_tokens=5, system_prompt=None)
    SearchRunner(rt.engine("gen"), rt.scorer("prm")).run(["What is two and two?"], config)
    assert steppers, "nothing stepped"
    assert set(steppers) == {str(LOOP_FILE)}


def test_a_stray_step_is_caught(tiny_model_dirs, steppers):
    """The watch above can fail: a direct call from here is seen as coming from this file."""
    engine = LLMEngine.__new__(LLMEngine)
    with pytest.raises(AttributeError):
        engine.step()
    assert steppers == [__file__]


def test_outputs_reach_their_owner_and_aborts_free_blocks(tiny_model_dirs):
    engine = LLM(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20,
                 max_model_len=256).engine
    loop, seen = EngineLoop(engine), []
    loop.add_request(engine, "a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), seen.append)
    loop.add_request(engine, "b", [1, 2, 3, 4], SamplingParams(max_tokens=50, ignore_eos=True), seen.append)
    loop.run_until(lambda: any(o.finished for o in seen))
    assert {o.request_id for o in seen} == {"a", "b"}
    assert loop.abort_request(engine, "b") and not loop.abort_request(engine, "b")
    assert engine.kv.num_blocks_in_use() == 0 and not loop.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="no engine holds"):
        loop.run_until(lambda: False)


def test_an_interactive_request_is_admitted_ahead_of_queued_search_work(tiny_model_dirs):
    engine = LLM(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20,
                 max_model_len=256, max_num_seqs=2).engine
    loop, finished = EngineLoop(engine), []
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for name in "abcd":
        loop.add_request(engine, name, [1, 2, 3], params, finished.append, priority=1)
    loop.step()  # a and b run; c and d wait
    loop.add_request(engine, "chat", [4, 5, 6], params, finished.append)
    assert [r.request_id for r in engine.scheduler.waiting] == ["chat#0", "c#0", "d#0"]
    loop.run_until(lambda: not loop.has_unfinished_requests())
    order = [o.request_id for o in finished if o.finished]
    assert order.index("chat") < order.index("c") and order.index("chat") < order.index("d")


def test_the_servers_queue_bound_counts_interactive_requests_only(tiny_model_dirs):
    """`--max-queue` refuses chats past a number of waiting chats; search samples and verifier work
    waiting behind them (priority 1) have their own bound and must not make a chat get 429."""
    from treeserve.engine.async_engine import AsyncLLMEngine
    from treeserve.engine.request import BACKGROUND_PRIORITY

    engine = LLM(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20,
                 max_model_len=256).engine
    served = AsyncLLMEngine(engine, max_queue=2, start_thread=False)
    for i in range(5):
        engine.add_request(f"search-{i}", [1, 2, 3], SamplingParams(max_tokens=2), priority=BACKGROUND_PRIORITY)
    assert served.num_waiting() == 0
    engine.add_request("chat-0", [1, 2, 3], SamplingParams(max_tokens=2))
    assert served.num_waiting() == 1


def test_the_loop_calls_it_a_deadlock_when_every_engine_waits_on_the_others_blocks(tiny_model_dirs, monkeypatch):
    """An engine whose waiting requests need blocks another model's requests hold idles a step (they
    free them as they end); when every engine with work does so for STALLED_PASSES passes in a row,
    nothing can free anything: the loop raises, naming what waits."""
    from treeserve.engine import engine_loop

    rt = Runtime({"gen": tiny_model_dirs["llama"], "prm": tiny_model_dirs["qwen2"]}, dtype="float32", device="cpu",
                 kv_cache_memory_bytes=8 << 20, max_model_len=256)
    loop = EngineLoop.of(rt.engines)
    for name, engine in rt.engines.items():
        loop.add_request(engine, name, [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True), lambda o: None)
    stalled = {"gen": True, "prm": False}
    monkeypatch.setattr(LLMEngine, "is_stalled", property(lambda engine: stalled[engine.name]))
    for _ in range(2 * engine_loop.STALLED_PASSES):
        loop.step()  # one engine runs: no deadlock
    stalled["prm"] = True
    for _ in range(engine_loop.STALLED_PASSES - 1):
        loop.step()
    with pytest.raises(RuntimeError, match=r"every model sharing it waits .*gen: \d+, prm: \d+"):
        loop.step()
