"""Writes tiny random-weight Hugging Face checkpoints with a real trained tokenizer.

The random `builtin:` models (model/registry.py), benchmarks and tests use these so that nothing is
ever downloaded. The weights come from transformers' own model classes (`save_pretrained`), so the
files are genuine HF checkpoints; the tokenizer is a small byte-level BPE trained on the spot with
`tokenizers`.
"""
from __future__ import annotations

import random
from pathlib import Path

from treeserve.errors import ParamError

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = (
    "the a of to and in is it that was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him "
    "two has look more day could go come did number sound no most people my over know water than call "
    "first who may down side been now find any new work part take get place made live where after back "
    "little only round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port large spell add "
    "step answer boxed plus minus times equals sum total value result"
).split()
_UNICODE = ["café", "naïve", "über", "日本語", "中文", "Привет", "😀", "🚀", "ñandú", "Ωμέγα", "€", "—"]


def training_corpus(seed: int = 0, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    corpus = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(_UNICODE))
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        sentence = " ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ":"])
        corpus.append(sentence)
    return corpus


def train_tokenizer(vocab_size: int = 512, seed: int = 0, corpus=None):
    """A byte-level BPE `PreTrainedTokenizerFast` with special tokens and a chat template, trained
    on `corpus` (an iterable of texts; default: made-up sentences)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(training_corpus(seed) if corpus is None else corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")  # 4 experts, top 2; tested apart (tests/test_moe.py)
PHI3_ORIGINAL_POSITIONS = 48  # the tiny Phi-3's LongRoPE switches to its long factors past this length
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3")  # tests/test_gemma.py
GEMMA_WINDOW = 16  # the tiny Gemma 2 and 3's sliding window: one KV block of 16 tokens


def _config(family: str, vocab_size: int, special: dict[str, int], **overrides):
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, initializer_range=0.15, **special)
    if family == "llama":
        cls, extra = transformers.LlamaConfig, dict(tie_word_embeddings=False)
    elif family == "llama3":  # Llama 3.x: llama3 RoPE scaling, tied embeddings, biases
        cls = transformers.LlamaConfig
        extra = dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64})
    elif family == "mistral":
        cls, extra = transformers.MistralConfig, dict(sliding_window=24, tie_word_embeddings=False)
    elif family == "qwen2":
        cls, extra = transformers.Qwen2Config, dict(tie_word_embeddings=True)
    elif family == "qwen3":
        cls, extra = transformers.Qwen3Config, dict(head_dim=24, tie_word_embeddings=False)
    elif family == "phi3":  # fused qkv and gate/up as shipped, LongRoPE (tests/test_phi3.py)
        half = common["hidden_size"] // common["num_attention_heads"] // 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(half)],
                "long_factor": [1.0 + 2.0 * i for i in range(half)]}
        cls = transformers.Phi3Config
        extra = dict(rope_parameters=rope, original_max_position_embeddings=PHI3_ORIGINAL_POSITIONS,
                     tie_word_embeddings=False, sliding_window=None)
    elif family in GEMMA_FAMILIES:
        cls, extra = _gemma_config(family)
    elif family == "mixtral":
        cls, extra = transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                                      tie_word_embeddings=False)
    elif family == "qwen2_moe":  # a shared expert; layer 0 dense, as mlp_only_layers allows
        cls = transformers.Qwen2MoeConfig
        extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                     mlp_only_layers=[0], norm_topk_prob=False, tie_word_embeddings=False)
    elif family == "qwen3_moe":
        cls = transformers.Qwen3MoeConfig
        extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, head_dim=24,
                     tie_word_embeddings=False)
    else:
        known = ", ".join(FAMILIES + MOE_FAMILIES + GEMMA_FAMILIES + ("phi3",))
        raise ParamError("family", f"unknown tiny-model family {family!r}; known: {known}")
    return cls(**{**common, **extra, **overrides})


def _gemma_config(family: str):
    """Gemma with head size 16 and a query scale of its own; Gemma 2 with caps small enough to bite
    on random weights (every other layer sliding); Gemma 3 with q/k norms, a linear-scaled global
    RoPE and a local one on its sliding layer."""
    import transformers

    common = dict(head_dim=16, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
    if family == "gemma":
        return transformers.GemmaConfig, dict(common, hidden_act="gelu_pytorch_tanh")
    if family == "gemma2":
        return transformers.Gemma2Config, dict(common, query_pre_attn_scalar=24, sliding_window=GEMMA_WINDOW,
                                               attn_logit_softcapping=4.0, final_logit_softcapping=6.0)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}
    return transformers.Gemma3TextConfig, dict(common, query_pre_attn_scalar=24, sliding_window=GEMMA_WINDOW,
                                               layer_types=["sliding_attention", "full_attention"],
                                               rope_parameters=rope)


def _perturb_norms(model, seed: int) -> None:
    """Gemma's norms start at w = 0 (scale 1 + w = 1): random w, so that the 1 + w is tested."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def make_tiny_model(family: str, path: str | Path, seed: int = 0, tokenizer_vocab_size: int = 512,
                    max_shard_size: str | None = None, favour_tokens: dict[str, float] | None = None,
                    tokenizer=None, **overrides) -> Path:
    """Writes config, safetensors weights, generation config and tokenizer to `path`.

    `overrides` go to the transformers config; a `vocab_size` there may exceed the tokenizer's.
    `favour_tokens` maps single-token texts to a logit they get at every position (about), so
    that a random model writes them often: "\n" makes it write blank-line separated steps.
    `tokenizer` (with bos, eos and pad tokens) replaces the trained one.
    """
    import torch
    import transformers

    path = Path(path)
    tokenizer = train_tokenizer(tokenizer_vocab_size, seed) if tokenizer is None else tokenizer
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    vocab_size = max(overrides.pop("vocab_size", 0), len(tokenizer))
    config = _config(family, vocab_size, special, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family in GEMMA_FAMILIES:
        _perturb_norms(model, seed)
    if favour_tokens:
        _favour(model, [_single_id(tokenizer, t) for t in favour_tokens], list(favour_tokens.values()))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    tokenizer.save_pretrained(path)
    return path


def _single_id(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ParamError("favour_tokens", f"{text!r} is {len(ids)} tokens, expected 1")
    return ids[0]


def _favour(model, token_ids: list[int], logits: list[float]) -> None:
    """Puts a large constant in one hidden dimension of every input embedding, which dominates the
    residual stream, so after the final norm every position is about sqrt(hidden) along it; the
    favoured output rows point along that dimension and get their logit everywhere."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if embed.data_ptr() == head.data_ptr():
        raise ParamError("favour_tokens", "needs a model with untied input and output embeddings")
    import torch

    hidden = embed.shape[1]
    with torch.no_grad():
        embed[:, 0] += 1000.0
        for token_id, logit in zip(token_ids, logits):
            head[token_id].zero_()
            head[token_id, 0] = logit / hidden ** 0.5


REWARD_SEPARATOR = "<extra_0>"  # Qwen2.5-Math-PRM's step separator, a special token of its own


def make_tiny_reward_model(architecture: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """A tiny Qwen2 process reward model with a head of its own (model/heads.py), random weights:
    `Qwen2ForProcessRewardModel` (`score`: Linear, ReLU, Linear to 2 labels) or `Qwen2ForPrmModel`
    (`v_head.summary`: Linear to 1). Its tokenizer has the `<extra_0>` separator. transformers has
    no class for either (the checkpoints ship their own code), so the body is written by
    `Qwen2ForCausalLM` and its lm_head swapped for the head."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    if architecture not in ("Qwen2ForProcessRewardModel", "Qwen2ForPrmModel"):
        raise ParamError("architecture", f"{architecture!r} is not a reward-head architecture")
    tokenizer = train_tokenizer(512, seed)
    tokenizer.add_tokens([REWARD_SEPARATOR], special_tokens=True)
    path = make_tiny_model("qwen2", path, seed, tokenizer=tokenizer, tie_word_embeddings=False, **overrides)
    config = json.loads((path / "config.json").read_text())
    hidden = config["hidden_size"]
    weights = load_file(str(path / "model.safetensors"))
    weights.pop("lm_head.weight")
    generator = torch.Generator().manual_seed(seed + 1)

    def normal(*shape, std):
        return torch.randn(*shape, generator=generator) * std
    if architecture == "Qwen2ForProcessRewardModel":
        weights.update({"score.0.weight": normal(hidden, hidden, std=hidden ** -0.5),
                        "score.0.bias": normal(hidden, std=0.1),
                        "score.2.weight": normal(2, hidden, std=3 * hidden ** -0.5),
                        "score.2.bias": normal(2, std=0.1)})
        config["id2label"], config["label2id"] = {"0": "LABEL_0", "1": "LABEL_1"}, {"LABEL_0": 0, "LABEL_1": 1}
    else:
        weights.update({"v_head.summary.weight": normal(1, hidden, std=2 * hidden ** -0.5),
                        "v_head.summary.bias": normal(1, std=0.1)})
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config["architectures"] = [architecture]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def make_tiny_eagle_head(kind: str, target: str | Path, path: str | Path, seed: int = 0, std: float = 0.05,
                         draft_vocab_size: int | None = None) -> Path:
    """A random EAGLE head (`kind` "eagle" or "eagle3") for the checkpoint at `target`, in the layout
    EAGLE's trainers write: config.json (a one-layer Llama config) and model.safetensors with `fc`,
    the layer (`layers.0.*`, EAGLE-3: `midlayer.*` with `hidden_norm`), and for EAGLE-3 `norm`,
    `lm_head` over `draft_vocab_size` tokens and `d2t` (target id = draft id + d2t) mapping them to
    the target's first, every other one."""
    import json

    import torch
    from safetensors.torch import save_file

    raw = json.loads((Path(target) / "config.json").read_text())
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    kv_heads, head_dim = raw.get("num_key_value_heads", heads), raw.get("head_dim") or hidden // heads
    inter, vocab = raw["intermediate_size"], raw["vocab_size"]
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return std * torch.randn(*shape, generator=generator)

    def norm():
        return 1 + 0.1 * torch.randn(hidden, generator=generator)

    prefix = "midlayer." if kind == "eagle3" else "layers.0."
    attention_in = 2 * hidden if kind == "eagle3" else hidden
    tensors = {f"{prefix}self_attn.q_proj.weight": randn(heads * head_dim, attention_in),
               f"{prefix}self_attn.k_proj.weight": randn(kv_heads * head_dim, attention_in),
               f"{prefix}self_attn.v_proj.weight": randn(kv_heads * head_dim, attention_in),
               f"{prefix}self_attn.o_proj.weight": randn(hidden, heads * head_dim),
               f"{prefix}mlp.gate_proj.weight": randn(inter, hidden), f"{prefix}mlp.up_proj.weight": randn(inter, hidden),
               f"{prefix}mlp.down_proj.weight": randn(hidden, inter),
               f"{prefix}post_attention_layernorm.weight": norm()}
    config = {"architectures": ["LlamaForCausalLM" if kind == "eagle" else "LlamaForCausalLMEagle3"],
              "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1, "vocab_size": vocab,
              "rms_norm_eps": raw.get("rms_norm_eps", 1e-6), "rope_theta": raw.get("rope_theta", 10000.0),
              "max_position_embeddings": raw.get("max_position_embeddings", 2048)}
    if kind == "eagle":
        tensors |= {"fc.weight": randn(hidden, 2 * hidden), "fc.bias": randn(hidden)}
    else:
        draft_vocab = draft_vocab_size or vocab
        ids = torch.arange(draft_vocab) * (2 if 2 * draft_vocab <= vocab else 1)
        tensors |= {"fc.weight": randn(hidden, 3 * hidden), f"{prefix}input_layernorm.weight": norm(),
                    f"{prefix}hidden_norm.weight": norm(), "norm.weight": norm(),
                    "lm_head.weight": randn(draft_vocab, hidden) * 20, "d2t": ids - torch.arange(draft_vocab),
                    "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)}
        config["draft_vocab_size"] = draft_vocab
        layers = raw["num_hidden_layers"]
        if layers < 6:  # (EAGLE-3's default layers 2, L/2 and L-3 need six of them)
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 1]}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    return path


BUILTIN_TINY_MODELS = {
    # `builtin:NAME` models written on first use (model/registry.py): a small random Llama.
    "tiny-random-llama": ("llama", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)),
}
