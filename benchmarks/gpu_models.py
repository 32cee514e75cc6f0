"""Models and peers for `benchmarks/gpu.py`: Llama-shaped model directories with random weights made on
the device (config.json and a tokenizer; treeserve loads them with `load_format="dummy"`), and HF
transformers' continuous batching (`generate_batch`'s manager) and static batching on the same shape.

The tokenizer is word-level over the model's whole vocabulary ("w0" ... "wN" plus special tokens,
"+" and "-"): any sampled id decodes to a word and the text tokenizes back to the same ids, so a
random generator's steps reach the PRM at their full length, and a step never contains the blank
line that ends a step early (steps of fixed length).
"""
from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import torch

SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|unk|>"]
TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                    tie_word_embeddings=True, rms_norm_eps=1e-5)
LLAMA_3_1_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                    tie_word_embeddings=False, rms_norm_eps=1e-5)
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, rms_norm_eps=1e-5)


def word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = SPECIAL + ["+", "-"]
    vocab = {name: i for i, name in enumerate(names)}
    vocab.update({f"w{i}": i for i in range(len(names), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIAL)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", unk_token="<|unk|>", clean_up_tokenization_spaces=False)
    fast.chat_template = TEMPLATE
    return fast


def model_dir(root: Path, name: str, shape: dict, max_positions: int) -> Path:
    """config.json and the tokenizer for a Llama of `shape` (no weights: treeserve makes them)."""
    import transformers

    path = root / name
    if (path / "config.json").is_file():
        return path
    tokenizer = word_tokenizer(shape["vocab_size"])
    config = transformers.LlamaConfig(**shape, max_position_embeddings=max_positions,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_model(path: Path, dtype: torch.dtype, device: torch.device):
    """The same shape in HF transformers, random weights made on the device, SDPA attention."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def free_memory(device) -> None:
    """What the last section left: collected, and its cached device blocks returned."""
    import gc

    gc.collect()
    if str(device).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_static(model, prompts: list[list[int]], lengths: list[int], batch_size: int, device: torch.device) -> dict:
    """HF `generate` in static batches (left padding), each run to its longest output; counted are
    the outputs asked for."""
    from treeserve.bench.offline import hf_static_batches

    seconds = hf_static_batches(model, prompts, lengths, batch_size, device, pad=model.config.pad_token_id or 0)
    return {"seconds": seconds, "output_tokens": sum(lengths), "tok_s": sum(lengths) / seconds,
            "batch_size": batch_size}


def hf_continuous(model, prompts: list[list[int]], lengths: list[int], use_cuda_graph: bool, timeout: float) -> dict:
    """HF's continuous batching (the manager behind `generate_batch`), each request with its own
    max_new_tokens, EOS off; counted are the tokens it returned."""
    from transformers import GenerationConfig

    generation = GenerationConfig(do_sample=False, max_new_tokens=max(lengths), eos_token_id=None,
                                  pad_token_id=model.config.pad_token_id)
    kwargs, note = {"generation_config": generation}, "defaults"
    try:
        from transformers import ContinuousBatchingConfig

        fields = inspect.signature(ContinuousBatchingConfig).parameters
        if "use_cuda_graph" in fields:
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(use_cuda_graph=use_cuda_graph)
            note = f"use_cuda_graph={use_cuda_graph}"
    except ImportError:
        note = "no ContinuousBatchingConfig in this transformers"
    manager = model.init_continuous_batching(**kwargs)
    manager.start()
    try:
        _run_requests(manager, prompts[:2], [8, 8], timeout, "warmup")  # (and graph capture)
        start = time.perf_counter()
        produced = _run_requests(manager, prompts, lengths, timeout, "request")
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return {"seconds": seconds, "output_tokens": produced, "tok_s": produced / seconds, "config": note}


def _run_requests(manager, prompts, lengths, timeout: float, prefix: str) -> int:
    ids = [manager.add_request(p, request_id=f"{prefix}{i}", max_new_tokens=n)
           for i, (p, n) in enumerate(zip(prompts, lengths))]
    pending, produced, deadline = set(ids), 0, time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        result = manager.get_result(timeout=1.0)
        if result is not None and result.request_id in pending and _finished(result):
            pending.discard(result.request_id)
            produced += len(result.generated_tokens)
    if pending:
        raise TimeoutError(f"HF continuous batching: {len(pending)} of {len(ids)} requests unfinished after {timeout} s")
    return produced


def _finished(result) -> bool:
    status = getattr(result, "status", None)
    return status is None or getattr(status, "name", str(status)).upper() == "FINISHED"


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes read and written per second by a device-to-device copy (best of `reps`)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        _synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
