"""Checkpoint directories: both config layouts, shards, dtypes, and errors that name the file."""
import json
import shutil

import pytest
import torch

from treeserve import LLM, SamplingParams
from treeserve.model.hf_config import load_model_config, parse_model_config
from treeserve.testing.tiny_models import make_tiny_model


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_legacy_rope_layout_reads_the_same(tiny_model_dirs, tmp_path):
    src = tiny_model_dirs["llama3"]
    modern = load_model_config(src)
    raw = json.loads((src / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = {**params, "type": params.pop("rope_type")}
    assert parse_model_config(raw) == modern
    assert modern.rope.rope_type == "llama3" and modern.rope.factor == 8.0


def test_family_switches(tiny_model_dirs):
    configs = {f: load_model_config(p) for f, p in tiny_model_dirs.items()}
    assert configs["qwen2"].qkv_bias and not configs["qwen2"].o_bias
    assert configs["qwen3"].qk_norm and configs["qwen3"].head_dim == 24
    assert configs["mistral"].sliding_windows == (24, 24)
    assert configs["llama3"].tie_word_embeddings and configs["llama3"].o_bias and configs["llama3"].mlp_bias
    assert configs["llama"].num_kv_heads == 2 and configs["llama"].num_heads == 4


def test_sharded_checkpoint_matches_single_file(tiny_model_dirs, tmp_path):
    sharded = make_tiny_model("llama", tmp_path / "sharded", seed=1, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = LLM(str(tiny_model_dirs["llama"]), dtype="float32", kv_cache_memory_bytes=4 << 20)
    many = LLM(str(sharded), dtype="float32", kv_cache_memory_bytes=4 << 20)
    assert one.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids == \
        many.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees(llama_dir, dtype):
    llm = LLM(str(llama_dir), dtype=dtype, kv_cache_memory_bytes=4 << 20)
    assert llm.engine.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize("broken, message", [
    ("config.json", "config.json: file not found"),
    ("model.safetensors", "model.safetensors: file not found"),
    ("tokenizer.json", "tokenizer.json"),
])
def test_missing_files_are_named(llama_dir, tmp_path, broken, message):
    path = _copy(llama_dir, tmp_path / "m")
    (path / broken).unlink()
    if broken == "tokenizer.json":
        (path / "tokenizer_config.json").unlink()
    with pytest.raises((FileNotFoundError, ValueError), match=message):
        LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_malformed_files_are_named(llama_dir, tmp_path, name):
    path = _copy(llama_dir, tmp_path / "m")
    (path / name).write_bytes(b"{not json")
    with pytest.raises(ValueError, match=name):
        LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)


def test_unsupported_architecture_lists_supported(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(path))


def test_missing_model_directory():
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        LLM("/nonexistent/model")


def test_generation_config_defaults(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "m")
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.9, eos_token_id=[5, 6])
    (path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)
    defaults = llm.get_default_sampling_params()
    assert defaults.temperature == 0.6 and defaults.top_p == 0.9
    assert llm.engine.loaded.eos_token_ids == (5, 6)


def test_bundled_directories_resolve_as_builtin_models(llama_dir, tmp_path, monkeypatch):
    from treeserve.model import registry

    shutil.copytree(llama_dir, tmp_path / "my-pair-gen")
    monkeypatch.setattr(registry, "BUNDLED_DIR", tmp_path)
    assert registry.resolve_model_path("builtin:my-pair-gen") == tmp_path / "my-pair-gen"
    assert "my-pair-gen" in registry.builtin_names() and "tiny-random-llama" in registry.builtin_names()
    with pytest.raises(ValueError, match="my-pair-gen"):
        registry.resolve_model_path("builtin:nope")


def test_the_tokenizer_is_the_one_auto_tokenizer_loads(tiny_model_dirs):
    """load_tokenizer skips AutoTokenizer's model config (2 s of each start); the result must not change."""
    from transformers import AutoTokenizer

    from treeserve.model.loader import load_tokenizer
    from treeserve.model.registry import resolve_model_path

    dirs = dict(tiny_model_dirs, arith_gen=resolve_model_path("builtin:arith-gen"))  # qwen2: Qwen2Tokenizer
    text = "Hello world 123 <|eos|> \u00fcn\u00efcode\n  x = 7*8"
    messages = [{"role": "user", "content": "What is 2+3?"}]
    for name, path in dirs.items():
        ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        assert type(ours) is type(theirs), name
        assert ours.encode(text) == theirs.encode(text) and len(ours) == len(theirs), name
        assert ours.all_special_ids == theirs.all_special_ids, name
        if theirs.chat_template:
            assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                    == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)), name
