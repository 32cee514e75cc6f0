"""lm-evaluation-harness against a live `treeserve serve`: a loglikelihood (multiple-choice) task and a
generate-until task on local JSON data, through its `local-completions` model (echo + logprobs),
against the same tasks run by its `hf` model on the same checkpoint."""
import json
import os

import pytest

from conftest import running_server

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is a test dependency: pip install -e '.[test]'")

QUESTIONS = [
    ("The water is", ["cold", "a long time ago", "near the people"], 0),
    ("Many people write about how to make", ["the best use of their time", "water", "a small boat"], 0),
    ("Step 1: add the two numbers", ["then double it", "and take away three", "."], 1),
    ("They said that every good answer needs", ["a hand", "time to read", "numbers"], 2),
    ("A long time ago in a place far away there was", ["one old man", "the water", "a number 42"], 0),
    ("café 日本語 😀", ["number 42", "is cold", "x"], 1),
]
MC_TASK = """task: ts_mc
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""
GEN_TASK = """task: ts_gen
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (root / "ts_mc.yaml").write_text(MC_TASK.format(data=data))
    (root / "ts_gen.yaml").write_text(GEN_TASK.format(data=data))
    return root


def _evaluate(model: str, model_args: dict, task_dir) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=["ts_mc", "ts_gen"],
                           task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                           apply_chat_template=False, random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def _loglikelihoods(results: dict) -> list[float]:
    samples = sorted(results["samples"]["ts_mc"], key=lambda s: s["doc_id"])
    return [resp[0][0] for s in samples for resp in s["resps"]]


def test_lm_eval_through_the_server_equals_hf_offline(llama_dir, tasks, monkeypatch):
    from treeserve.server.launch import build_app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tasks / "datasets-cache"))
    app = build_app(str(llama_dir), served_model_name="tiny", dtype="float32", device="cpu",
                    kv_cache_memory_bytes=32 << 20, max_model_len=512)
    with running_server(app) as url:
        served = _evaluate("local-completions", {
            "model": "tiny", "base_url": f"{url}/v1/completions", "tokenizer": str(llama_dir),
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 2, "max_retries": 1,
            "max_length": 512}, tasks)
    offline = _evaluate("hf", {"pretrained": str(llama_dir), "dtype": "float32", "device": "cpu",
                               "max_length": 512}, tasks)
    ours, ref = _loglikelihoods(served), _loglikelihoods(offline)
    assert len(ours) == sum(len(c) for _, c, _ in QUESTIONS)
    print(f"lm-eval loglikelihoods: {len(ours)}, largest |served - HF| {max(abs(a - b) for a, b in zip(ours, ref)):.2e}")
    assert ours == pytest.approx(ref, abs=1e-3)
    assert served["results"]["ts_mc"]["acc,none"] == offline["results"]["ts_mc"]["acc,none"]
    generated = [s["resps"][0][0] for s in sorted(served["samples"]["ts_gen"], key=lambda s: s["doc_id"])]
    expected = [s["resps"][0][0] for s in sorted(offline["samples"]["ts_gen"], key=lambda s: s["doc_id"])]
    assert len(generated) == len(QUESTIONS) and generated == expected
