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


@pytest.mark.parametrize("below", ["snapshots/0123abcd", "my-llama"])
def test_a_folder_above_a_checkpoint_names_the_checkpoint(llama_dir, tmp_path, below):
    """(`--model ~/.cache/huggingface/hub/models--org--name` said only ".../config.json: file not found")"""
    _copy(llama_dir, tmp_path / "above" / below)
    with pytest.raises(FileNotFoundError) as refused:
        LLM(str(tmp_path / "above"), dtype="float32", kv_cache_memory_bytes=4 << 20)
    assert str(refused.value) == (f"{tmp_path / 'above' / 'config.json'}: file not found: {tmp_path / 'above'} is not "
                                  f"a Hugging Face checkpoint directory; did you mean {tmp_path / 'above' / below}?")


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


def test_a_missing_tensor_is_named_as_the_checkpoint_names_it(llama_dir, tmp_path):
    """A fused projection's missing part by its own name (it said `layers.0.self_attn.qkv_proj.weight`,
    a tensor no checkpoint holds, and not which of q, k, v was missing)."""
    from safetensors.torch import load_file, save_file

    path = _copy(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    for gone in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        del tensors[gone]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError) as caught:
        LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)
    assert "lacks the tensors ['model.layers.0.self_attn.k_proj.weight', 'model.layers.1.mlp.down_proj.weight']" \
        in str(caught.value), caught.value


def test_an_unsupported_rope_type_is_said_to_be_unsupported_not_malformed(llama_dir, tmp_path):
    path = _copy(llama_dir, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    raw["rope_scaling"] = yarn
    raw["rope_parameters"] = {**(raw.get("rope_parameters") or {}), **yarn}  # (transformers 5 writes this one)
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unsupported setting .*'yarn' is not supported"):
        LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)


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
    assert llm.engine.loaded.eos_token_ids == (5, 6, 2)  # and the tokenizer's eos, as vLLM


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

    from treeserve.model.tokenizer import load_tokenizer
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


def _mapping_of(address: int) -> str | None:
    """The file mapped at `address` in this process (None: anonymous memory)."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


def test_an_untied_embedding_is_read_in_place_from_the_checkpoint_file(tiny_model_dirs):
    """Its rows are looked up, never read whole: the file's own pages, not a copy in the process's
    memory (model/mapped_embedding.py). A tied one (the LM head reads it whole each step), one in
    another dtype than the file's and any with `load_format="safetensors"` are copied in."""
    from safetensors.torch import load_file

    untied, tied = tiny_model_dirs["llama"], tiny_model_dirs["llama3"]
    llm = LLM(str(untied), dtype="float32", kv_cache_memory_bytes=4 << 20)
    weight = llm.engine.model.embed_tokens.weight
    assert _mapping_of(weight.data_ptr()) == str((untied / "model.safetensors").resolve())
    assert torch.equal(weight, load_file(str(untied / "model.safetensors"))["model.embed_tokens.weight"])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids) == 8
    # (and `load_format="safetensors"`, vLLM's name for weights read into memory, copies it too)
    for path, dtype, load_format in ((tied, "float32", "auto"), (untied, "bfloat16", "auto"),
                                     (untied, "float32", "safetensors")):
        model = LLM(str(path), dtype=dtype, kv_cache_memory_bytes=4 << 20, load_format=load_format).engine.model
        assert all(_mapping_of(t.data_ptr()) is None for t in model.embed_tokens.parameters()), (path.name, dtype)


def _file_rss(path) -> int:
    """Bytes of `path`'s pages resident in this process's mappings of it."""
    rss, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(maxsplit=1)[0] and not line.startswith(("Rss", "Pss")):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1]) * 1024
    return rss


def test_a_load_lets_go_of_the_file_pages_it_has_read(tmp_path, monkeypatch):
    """safetensors maps the whole file per handle, and the pages its tensors touched stay the
    process's (its RSS) until the handle closes: the loader opens a new one every REOPEN_BYTES (model/checkpoint_files.py), so
    a load's RSS holds a span of the file, not all of it (a 1B bfloat16 load peaked 2.3 GiB higher)."""
    from safetensors.torch import save_file

    from treeserve.model import checkpoint_files

    path = (tmp_path / "model.safetensors").resolve()
    save_file({f"t{i:02d}": torch.full((1 << 20,), float(i)) for i in range(16)}, str(path))  # 16 x 4 MiB
    monkeypatch.setattr(checkpoint_files, "REOPEN_BYTES", 8 << 20)
    most = 0
    for name, tensor in checkpoint_files.iter_checkpoint_tensors(tmp_path):
        assert float(tensor.sum()) == int(name[1:]) * (1 << 20)  # every page read
        most = max(most, _file_rss(path))
    assert 4 << 20 <= most <= 13 << 20  # this handle's 8 MiB and the tensor that passed it, not 64 MiB
