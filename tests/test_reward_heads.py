"""Process reward models with heads of their own (model/heads.py): Qwen2.5-Math-PRM's two-class
head (`Qwen2ForProcessRewardModel`, recipe qwen-prm) and a value head (`Qwen2ForPrmModel`, recipe
value-head), random tiny checkpoints, against transformers' Qwen2 body with the head applied to
its hidden states as the checkpoints' own code does (transformers ships no class for either)."""
import httpx
import pytest
import torch
from safetensors.torch import load_file

from conftest import running_server
from treeserve import LLM, Runtime
from treeserve.cli import main
from treeserve.errors import ParamError
from treeserve.runtime.prm_recipes import declared_recipe
from treeserve.server.launch import build_app
from treeserve.testing.tiny_models import make_tiny_reward_model

ARCHITECTURES = ("Qwen2ForProcessRewardModel", "Qwen2ForPrmModel")
QUESTION = "Add two and three, then double it. What is the result?"
STEPS = ["Two plus three is five.", "Five doubled is ten, so the value is now ten.", "The answer is ten."]
OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=512)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def reward_model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("reward-heads")
    return request.param, make_tiny_reward_model(request.param, root / request.param, seed=3)


def reference_scores(architecture: str, path, question: str, steps: list[str]) -> list[float]:
    """Each checkpoint's published recipe, on transformers' Qwen2 body: Qwen2.5-Math-PRM's chat
    with `<extra_0>` after every step, read at every separator; Skywork's pieces tokenized apart
    with a newline token after each step, read at those."""
    from transformers import AutoTokenizer, Qwen2Model

    tokenizer = AutoTokenizer.from_pretrained(path)
    body = Qwen2Model.from_pretrained(path, dtype=torch.float32).eval()
    weights = load_file(str(path / "model.safetensors"))
    if architecture == "Qwen2ForProcessRewardModel":
        messages = [{"role": "system", "content": "Please reason step by step, and put your final answer within "
                     "\\boxed{}."}, {"role": "user", "content": question},
                    {"role": "assistant", "content": "<extra_0>".join(steps) + "<extra_0>"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        positions = [i for i, t in enumerate(ids) if t == tokenizer.convert_tokens_to_ids("<extra_0>")]
    else:
        ids = tokenizer.encode(tokenizer.bos_token + question + "\n", add_special_tokens=False)
        newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
        positions = []
        for step in "\n".join(steps).split("\n"):
            ids += tokenizer.encode(step, add_special_tokens=False) + [newline]
            positions.append(len(ids) - 1)
    with torch.no_grad():
        hidden = body(torch.tensor([ids])).last_hidden_state[0]
        if architecture == "Qwen2ForProcessRewardModel":
            inner = torch.relu(hidden @ weights["score.0.weight"].T + weights["score.0.bias"])
            logits = inner @ weights["score.2.weight"].T + weights["score.2.bias"]
            return torch.softmax(logits, dim=-1)[positions, 1].tolist()
        values = hidden @ weights["v_head.summary.weight"].T + weights["v_head.summary.bias"]
        return torch.sigmoid(values[positions, 0]).tolist()


def test_step_scores_match_the_reference_with_chunks_and_reuse(reward_model):
    """Steps 1-2 scored first, then 1-3: the second extends the first's kept sequence; prefills
    go in chunks of 16 tokens (every input is longer)."""
    architecture, path = reward_model
    runtime = Runtime({"prm": str(path)}, max_num_batched_tokens=16, **OPTIONS)
    try:
        scorer = runtime.scorer("prm")
        assert len(scorer.build(QUESTION, STEPS[:1]).token_ids) > 16
        first = runtime.score_steps("prm", QUESTION, STEPS[:2])
        reused = scorer.num_reused_tokens
        full = runtime.score_steps("prm", QUESTION, STEPS)
    finally:
        runtime.close()
    expected = reference_scores(architecture, path, QUESTION, STEPS)
    assert len(full) == len(expected) == len(STEPS), (full, expected)  # one score a step, none left out by zip
    assert len(first) == 2, first
    assert max(abs(a - b) for a, b in zip(full, expected)) < 1e-4, (full, expected)
    assert max(abs(a - b) for a, b in zip(first, expected[:2])) < 1e-4
    assert scorer.num_reused_tokens > reused  # the longer conversation reused the shorter one's tokens
    assert max(expected) - min(expected) > 0.01  # the scores differ by step: the test can tell them apart


def test_a_reward_model_declares_its_recipe_and_refuses_to_generate(reward_model):
    architecture, path = reward_model
    assert declared_recipe(path) == {"Qwen2ForProcessRewardModel": "qwen-prm", "Qwen2ForPrmModel": "value-head"}[
        architecture]
    llm = LLM(str(path), **OPTIONS)
    with pytest.raises(ParamError, match="process reward model"):
        llm.generate("Hello", use_tqdm=False)
    with pytest.raises(ParamError, match="recipe"):
        Runtime({"prm": str(path)}, recipes={"prm": "rlhflow"}, **OPTIONS).scorer("prm")


def test_served_rewards_and_a_search_with_it_as_the_verifier(reward_model, llama_dir, capsys):
    architecture, path = reward_model
    app = build_app({"gen": str(llama_dir), "prm": str(path)}, **OPTIONS)
    with running_server(app) as url:
        served = httpx.post(f"{url}/v1/rewards", json={"model": "prm", "question": QUESTION, "steps": STEPS},
                            timeout=60)
        refused = httpx.post(f"{url}/v1/completions", json={"model": "prm", "prompt": "Hi", "max_tokens": 2},
                             timeout=60)
        as_generator = httpx.post(f"{url}/v1/search", json={"model": "prm", "verifier": "prm", "question": QUESTION,
                                                            "strategy": "best_of_n", "n": 2}, timeout=60)
    assert served.status_code == 200, served.text
    scores = served.json()["scores"]
    assert served.json()["recipe"] == declared_recipe(path)
    expected = reference_scores(architecture, path, QUESTION, STEPS)
    assert len(scores) == len(expected) == len(STEPS), (scores, expected)  # one score a step, none left out by zip
    assert max(abs(a - b) for a, b in zip(scores, expected)) < 1e-4
    assert refused.status_code == 400 and "process reward model" in refused.text
    assert as_generator.status_code == 400 and as_generator.json()["error"]["param"] == "model"
    assert "'prm' is a process reward model" in as_generator.json()["error"]["message"]
    assert main(["search", "--generator", str(llama_dir), "--verifier", str(path), "--n", "4", "--beam-width", "2",
                 "--num-iterations", "2", "--max-tokens", "24", "--dtype", "float32", "--device", "cpu",
                 "--kv-cache-memory-bytes", str(16 << 20), QUESTION]) == 0
    assert "--- answer" in capsys.readouterr().out


def test_the_reference_mode_refuses_a_reward_head(reward_model):
    """Search-and-Learn's reference mode loads a causal LM: it cannot read a reward head."""
    from transformers import AutoTokenizer

    from treeserve.search.reference import HFStepScorer
    _, path = reward_model
    recipe = declared_recipe(path)
    with pytest.raises(ParamError, match="reward head"):
        HFStepScorer(str(path), AutoTokenizer.from_pretrained(path), recipe)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
    ("/v1/search", {"question": QUESTION, "strategy": "greedy"}),
])
def test_a_request_without_model_on_a_server_of_a_reward_model_only_says_none_generates(reward_model, path, body):
    """Left out, `model` was a 400 `missing_required_parameter` ("this field is required ... none is served")
    though naming the one served model was `model_not_a_generator`: both are the latter, naming the reward
    model (vLLM answers a pooling model's chat the same, named or not)."""
    architecture, model_path = reward_model
    app = build_app(str(model_path), served_model_name="rm", **OPTIONS)
    with running_server(app) as url:
        unnamed = httpx.post(url + path, json=body, timeout=60)
        named = httpx.post(url + path, json=body | {"model": "rm"}, timeout=60)
    for response in (unnamed, named):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "model" and error["code"] == "model_not_a_generator", error
        assert f"'rm' is a process reward model ({architecture})" in error["message"], error
    assert unnamed.json()["error"]["message"].startswith("model: no generator is served: 'rm' is a process")
