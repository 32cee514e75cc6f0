"""`echo` with `logprobs` on /v1/completions (how lm-evaluation-harness scores loglikelihoods),
through the official `openai` client, against HF transformers' log-softmax."""
import openai
import pytest
import torch
import transformers

from conftest import assert_no_leak, wait_idle

PROMPT = "The water is cold and the people who live near it make their time"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0)


@pytest.fixture(scope="module")
def reference(llama_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    ids = tokenizer.encode(PROMPT)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return tokenizer, ids, torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_prompt_part(logprobs, tokenizer, ids, ref, top: int) -> None:
    assert logprobs.tokens[:len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert logprobs.token_logprobs[pos] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
        best = ref[pos - 1].topk(top)
        values = sorted(logprobs.top_logprobs[pos].values(), reverse=True)  # the top and the token's own (k+1)
        assert values[:top] == pytest.approx(best.values.tolist(), abs=1e-4) and len(values) <= top + 1
        assert logprobs.top_logprobs[pos][logprobs.tokens[pos]] == pytest.approx(logprobs.token_logprobs[pos])
    text = "".join(logprobs.tokens[:len(ids)])
    assert logprobs.text_offset[:len(ids)] == [len("".join(logprobs.tokens[:i])) for i in range(len(ids))]
    assert text


def test_echo_with_logprobs_returns_the_prompts_logprobs(client, reference, server):
    tokenizer, ids, ref = reference
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.logprobs.tokens) == len(ids) + 3
    _check_prompt_part(choice.logprobs, tokenizer, ids, ref, 2)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 3
    wait_idle(server.engine)
    assert_no_leak(server.engine)


def test_max_tokens_zero_with_echo_returns_the_prompt_alone(client, reference):
    tokenizer, ids, ref = reference
    out = client.completions.create(model="tiny", prompt=[ids, ids[:5]], max_tokens=0, echo=True, logprobs=1)
    first, second = out.choices
    assert first.text == tokenizer.decode(ids) and len(first.logprobs.tokens) == len(ids)
    _check_prompt_part(first.logprobs, tokenizer, ids, ref, 1)
    assert len(second.logprobs.tokens) == 5
    assert out.usage.completion_tokens == 0 and out.usage.total_tokens == len(ids) + 5
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)


def test_streamed_echo_sends_the_prompts_logprobs_first(client, reference):
    tokenizer, ids, ref = reference
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT)
    _check_prompt_part(first.logprobs, tokenizer, ids, ref, 2)
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert len(tokens) == len(ids) + 4
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert tokens == whole.choices[0].logprobs.tokens


def test_vllms_prompt_logprobs_field(client, reference):
    tokenizer, ids, ref = reference
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for pos in range(1, len(ids)):
        assert entries[pos][str(ids[pos])]["logprob"] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="tiny", prompt=PROMPT, extra_body={"prompt_logprobs": 99})


def test_vllms_prompt_logprobs_on_chat(client, llama_dir, server):
    messages = [{"role": "user", "content": PROMPT}]
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                         extra_body={"prompt_logprobs": 2})
    entries = out.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids) == out.usage.prompt_tokens
    for pos in range(1, len(ids)):
        assert entries[pos][str(ids[pos])]["logprob"] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(model="tiny", messages=messages, stream=True, extra_body={"prompt_logprobs": 1})
