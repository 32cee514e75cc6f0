"""scripts/train_arith.py end to end at toy sizes: every stage (language model, verifier, PRM, tool router)
runs and writes checkpoints treeserve loads."""
import importlib.util
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from treeserve.runtime.runtime import Runtime
from treeserve.search.config import declared_aggregation

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_arith.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_arith", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("data", [["--format", "levels", "--prm-slips", "classic"],  # the earlier pair's
                                  ["--format", "whole", "--prm-slips", "all",        # issue #39's
                                   "--prm-operand-weight", "1", "--router-layers", "2"]])
def test_training_script_writes_a_plain_generator_and_prm(tmp_path, data):
    out, work = tmp_path / "models", tmp_path / "work"
    toy = ["--lm-steps", "3", "--gen-step", "2", "--eval-every", "0", "--batch-size", "4", "--eval-problems", "5",
           "--prm-reference-steps", "2", "--prm-steps", "2", "--prm-problems", "6", "--prm-samples", "2",
           "--prm-operator-weight", "1", "--prm-token-weight", "0.5", "--stages", "lm,prm,router",
           "--router-steps", "2", "--router-batch-size", "2",
           *data]
    assert _load_script().main(["--out", str(out), "--work", str(work), *toy]) == 0
    report = json.loads((work / "training.json").read_text())
    assert set(report["prm_auc_validation_samples"]) == {"pooled", "siblings", "solutions_by_min"}
    assert 0 <= report["router_exact_calls_validation"]["all"] <= 1
    router = json.loads((out / "arith-router" / "tokenizer_config.json").read_text())
    assert router["eos_token"] == "<|im_end|>" and (out / "arith-router" / "chat_template.jinja").is_file()
    config = json.loads((out / "arith-prm" / "config.json").read_text())
    assert config["prm_recipe"] == "chat-steps" and config["prm_aggregation"] == "min"
    with safe_open(str(out / "arith-prm" / "model.safetensors"), "pt") as weights:
        assert not any("training_heads" in name for name in weights.keys())  # dropped before saving
    scores = _score(out / "arith-prm")
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores)


def _score(model_dir: Path) -> list[float]:
    rt = Runtime({"prm": str(model_dir)}, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20)
    try:
        assert declared_aggregation(rt.engine("prm").model_dir) == "min"
        question = "Start with 40 and work modulo 100. Step 1: + 5. What is the result?"
        return rt.score_steps("prm", question, ["## Step 1: + 5, 40 + 5 = 45", "Therefore, the final answer is: $\\boxed{45}$."])
    finally:
        rt.close()


def test_default_stages_write_a_generator_and_a_likelihood_verifier(tmp_path):
    out, work = tmp_path / "models", tmp_path / "work"
    toy = ["--lm-steps", "3", "--verifier-steps", "2", "--eval-every", "0", "--batch-size", "4", "--eval-problems", "5"]
    assert _load_script().main(["--out", str(out), "--work", str(work), *toy]) == 0  # lm,verifier; whole format
    report = json.loads((work / "training.json").read_text())
    assert set(report["verifier_auc_validation_samples"]) == {"pooled", "siblings", "solutions_by_min"}
    config = json.loads((out / "arith-prm" / "config.json").read_text())
    assert config["prm_recipe"] == "lm-likelihood" and config["architectures"] == ["LlamaForCausalLM"]
    generator = (out / "arith-gen" / "model.safetensors").read_bytes()
    assert generator == (work / "lm-final" / "model.safetensors").read_bytes()  # the last step by default
    assert generator != (out / "arith-prm" / "model.safetensors").read_bytes()  # its own seed and data
    scores = _score(out / "arith-prm")
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores)
