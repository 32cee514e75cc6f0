"""`eagle` / `eagle3` speculation with random tiny heads in EAGLE's checkpoint layout: each proposal's
drafts equal a plain PyTorch reference of the head fed with HF transformers' features of the same
tokens (so the head, the target's features and the proposer's bookkeeping across kept and rejected
drafts are all checked), greedy outputs equal decoding without speculation on every family, and
nothing is left held."""
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import assert_no_leak
from test_spec_decode import PROMPTS, _llm, _tokens
from treeserve import SamplingParams
from treeserve.errors import ParamError
from treeserve.testing.tiny_models import FAMILIES, make_tiny_eagle_head, make_tiny_model

KINDS = ("eagle", "eagle3")


def _head(kind, target, tmp_path, **options):
    return make_tiny_eagle_head(kind, target, tmp_path / f"{kind}-head", **options)


def _spec(kind, head, k=3):
    return {"method": kind, "model": str(head), "num_speculative_tokens": k}


# ---- a plain PyTorch reference of the heads --------------------------------------------------
class ReferenceHead:
    """EAGLE / EAGLE-3 written out with torch ops over whole sequences (no cache), from the
    checkpoint's tensors; the target's features from HF transformers."""

    def __init__(self, kind, head_dir, target_dir):
        import json

        import transformers

        self.kind = kind
        self.w = {k.removeprefix("midlayer.").removeprefix("layers.0."): v.double()
                  for k, v in load_file(head_dir / "model.safetensors").items()}
        self.config = json.loads((head_dir / "config.json").read_text())
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
        layers = self.hf.config.num_hidden_layers
        self.aux = self.config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids",
                                                          [2, layers // 2, layers - 3])

    def features(self, tokens):
        """The target's feature of each position: its final hidden state (eagle) or fc of the
        streams entering three layers (eagle3)."""
        with torch.no_grad():
            out = self.hf(torch.tensor([tokens]), output_hidden_states=True)
        if self.kind == "eagle":
            return out.hidden_states[-1][0]
        streams = torch.cat([out.hidden_states[i][0] for i in self.aux], dim=-1)
        return streams @ self.w["fc.weight"].T

    def drafts(self, tokens, k):
        """Greedy drafts after `tokens` (the last one not yet computed by the target)."""
        features = self.features(tokens[:-1])
        inputs = list(tokens[1:])
        drafts = []
        for _ in range(k):
            token, feature = self._last(inputs, features)
            drafts.append(token)
            inputs.append(token)
            features = torch.cat([features, feature[None]])
        return drafts

    def _last(self, inputs, features):
        w, eps = self.w, self.config["rms_norm_eps"]
        embeds = self.hf.get_input_embeddings().weight[torch.tensor(inputs)]
        if self.kind == "eagle":
            x = torch.cat([embeds, features], dim=-1) @ w["fc.weight"].T + w.get("fc.bias", 0)
            residual = x
        else:
            x = torch.cat([_rms(embeds, w["input_layernorm.weight"], eps), _rms(features, w["hidden_norm.weight"], eps)], -1)
            residual = features
        r = self._attention(x) + residual
        h = _rms(r, w["post_attention_layernorm.weight"], eps)
        pre = (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T + r
        if self.kind == "eagle":
            logits = self.hf.get_output_embeddings().weight @ pre[-1]
            return int(logits.argmax()), pre[-1]
        d = int((w["lm_head.weight"] @ _rms(pre[-1], w["norm.weight"], eps)).argmax())
        return d + int(self.w["d2t"][d]), pre[-1]

    def _attention(self, x):
        c, w = self.config, self.w
        heads, kv_heads, dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        n = x.shape[0]
        q = (x @ w["self_attn.q_proj.weight"].T).view(n, heads, dim)
        k = (x @ w["self_attn.k_proj.weight"].T).view(n, kv_heads, dim)
        v = (x @ w["self_attn.v_proj.weight"].T).view(n, kv_heads, dim)
        q, k = _rope(q, c["rope_theta"]), _rope(k, c["rope_theta"])
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * dim)
        return out @ w["self_attn.o_proj.weight"].T


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, theta):
    n, _, dim = x.shape
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = (torch.cat([f(angles)] * 2, -1)[:, None] for f in (torch.cos, torch.sin))
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole-prefill", "chunked-prefill"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_draft_equals_the_reference_head_on_the_targets_features(llama_dir, tmp_path, kind, chunk):
    """Each proposal's drafts against the reference fed the whole sequence so far: the first
    proposal (the prompt's features), and every later one. A random head's drafts are never kept,
    so the step verifies the greedy reference's next tokens instead (every third draft spoiled): the
    head's bookkeeping then meets kept drafts (their rows' features) and rejected ones alike."""
    head = _head(kind, llama_dir, tmp_path, std=0.3, draft_vocab_size=200 if kind == "eagle3" else None)
    prompts = PROMPTS[:2]
    expected = _tokens(_llm(llama_dir), prompts=prompts)
    continuation = {tuple(p): out[0] for p, out in zip(prompts, expected)}
    chunked = {"max_num_batched_tokens": chunk} if chunk else {}  # (the prompts' features over several steps)
    llm = _llm(llama_dir, enable_prefix_caching=False, speculative_config=_spec(kind, head), **chunked)
    engine = llm.engine
    engine.speculator.costs.keep_threshold = lambda batch: 0.02  # a draft at every step
    proposer = engine.speculator.proposers[engine.speculator.config]
    proposer.pass_costs.share_of = lambda token_seconds: 0.0  # (and so every step's features kept)
    seen, propose_all = [], proposer.propose_all

    def verified_instead(wanted):
        heads = propose_all(wanted)
        seen.extend((list(r.all_token_ids), d) for (r, _, _), d in zip(wanted, heads))
        drafts = []
        for (request, _, _), d in zip(wanted, heads):
            done = request.num_output_tokens
            draft = list(continuation[tuple(request.prompt_token_ids)][done:done + len(d)])
            if len(seen) % 3 == 0 and draft:
                draft[-1] = (draft[-1] + 1) % 64
            drafts.append(draft)
        return drafts
    proposer.propose_all = verified_instead
    assert _tokens(llm, prompts=prompts) == expected
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    reference = ReferenceHead(kind, head, llama_dir)
    assert len(seen) >= 10 and any(len(d) > 1 for _, d in seen)
    for tokens, drafts in seen:
        assert drafts == reference.drafts(tokens, len(drafts)), len(tokens)
    assert_no_leak(engine)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_decoding_without_speculation(tiny_model_dirs, tmp_path, family, kind):
    path = tiny_model_dirs[family]
    expected = _tokens(_llm(path))
    llm = _llm(path, speculative_config=_spec(kind, _head(kind, path, tmp_path)))
    llm.engine.speculator.costs.keep_threshold = lambda batch: 0.02
    assert _tokens(llm) == expected
    assert _tokens(llm) == expected  # again: prefix-cache hits (positions without features read zeros)
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert not llm.engine.uses_cuda_graphs
    assert_no_leak(llm.engine)


def test_n_greater_than_one_preemption_and_aborts_leave_nothing_held(llama_dir, tmp_path):
    head = _head("eagle3", llama_dir, tmp_path)
    per_block = (8 << 20) // _llm(llama_dir).engine.kv.pool.num_blocks
    llm = _llm(llama_dir, kv_cache_memory_bytes=per_block * 10, max_model_len=128,
               speculative_config=_spec("eagle3", head))
    engine = llm.engine
    engine.speculator.costs.keep_threshold = lambda batch: 0.02
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=2)
    plain = _llm(llama_dir).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in plain]
    assert engine.scheduler.num_preemptions > 0
    for i in range(40):
        engine.add_request(f"a{i}", list(PROMPTS[i % len(PROMPTS)]), SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(5):
        engine.step()
    for i in range(0, 40, 3):
        engine.abort_request(f"a{i}")
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.speculator.proposers[engine.speculator.config].sequences
    assert_no_leak(engine)


def test_eagle_errors_name_the_problem(llama_dir, tmp_path):
    wide = make_tiny_model("llama", tmp_path / "wide", seed=1, hidden_size=96)
    with pytest.raises(ParamError, match="hidden_size 96 is not the target's"):
        _llm(llama_dir, speculative_config=_spec("eagle", _head("eagle", wide, tmp_path)))
    broken = _head("eagle3", llama_dir, tmp_path)
    tensors = load_file(broken / "model.safetensors")
    del tensors["norm.weight"]
    from safetensors.torch import save_file
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ParamError, match="lacks norm.weight"):  # (at start: the weights load at the first draft)
        _llm(llama_dir, speculative_config=_spec("eagle3", broken))


def test_a_runtime_gives_the_head_to_the_model_it_fits(pair, tmp_path):
    """A generator and a PRM of another width in one Runtime with an EAGLE-3 head for the generator:
    the PRM decodes without it (said in the log), a greedy search's text is that without
    speculation, and the head's KV comes from the shared pool and goes back to it."""
    from treeserve import Runtime
    from treeserve.search.config import SearchConfig, declared_aggregation
    from treeserve.search.runner import SearchRunner

    head = _head("eagle3", pair["gen"], tmp_path)
    options = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20, max_model_len=256)
    base = dict(strategy="beam", n=4, beam_width=2, num_iterations=3, max_tokens=12, system_prompt=None, seed=3,
                agg_strategy=declared_aggregation(pair["prm"]), temperature=0.0)
    plain = Runtime(pair, **options)
    expected = SearchRunner(plain.engine("gen"), plain.scorer("prm")).run(["Add two and three."], SearchConfig(**base))
    rt = Runtime(pair, speculative_config=_spec("eagle3", head), **options)
    gen, prm = rt.engine("gen"), rt.engine("prm")
    assert prm.speculator.config is None and gen.speculator.capture == "aux"
    gen.speculator.costs.keep_threshold = lambda batch: 0.02
    config = SearchConfig(**base, speculative_config=_spec("eagle3", head))
    got = SearchRunner(gen, rt.scorer("prm")).run(["Add two and three."], config)
    assert got[0].completions == expected[0].completions
    assert gen.stats().spec_decode_num_draft_tokens > 0
    assert gen.kv.pool.num_in_use_by("gen:eagle3") == 0
    assert gen.kv.num_blocks_in_use() == gen.retained.num_blocks()


def test_no_block_leaks_after_a_thousand_requests_with_aborts(llama_dir, tmp_path):
    from test_spec_decode import thousand_requests_with_aborts

    llm = _llm(llama_dir, speculative_config=_spec("eagle3", _head("eagle3", llama_dir, tmp_path), k=4))
    engine = thousand_requests_with_aborts(llm, max_tokens=20)
    assert engine.stats().spec_decode_num_draft_tokens > 1000
    assert not engine.speculator.proposers[engine.speculator.config].sequences
    assert_no_leak(engine)
