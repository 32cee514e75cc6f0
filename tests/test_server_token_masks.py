"""vLLM's extra body parameters bad_words, allowed_token_ids and truncate_prompt_tokens on
/v1/completions and /v1/chat/completions, through the official `openai` client's `extra_body`:
streamed and not, with n > 1, and 400s naming the field before any stream starts."""
import openai
import pytest

from treeserve.engine.token_masks import bad_word_sequences

MESSAGES = [{"role": "user", "content": "Tell me about the water"}]
PROMPT = "The water is"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0)


def _contains(tokens, seq) -> bool:
    return any(list(tokens[i:i + len(seq)]) == list(seq) for i in range(len(tokens)))


def test_allowed_token_ids_on_completions_streamed_and_not(client, server):
    tokenizer = server.engine.tokenizer
    allowed = sorted(set(tokenizer.encode("the water is cold and the sea is deep", add_special_tokens=False)))
    extra = {"allowed_token_ids": allowed, "return_token_ids": True}
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, n=3, temperature=1.0, seed=2,
                                      extra_body=extra)
    assert all(set(c.token_ids) <= set(allowed) and c.token_ids for c in reply.choices)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, n=2, temperature=1.0,
                                            seed=2, stream=True, extra_body=extra))
    streamed = [t for chunk in chunks for c in chunk.choices for t in (getattr(c, "token_ids", None) or [])]
    assert streamed and set(streamed) <= set(allowed)
    free = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, n=3, temperature=1.0, seed=2,
                                     extra_body={"return_token_ids": True})
    assert any(not set(c.token_ids) <= set(allowed) for c in free.choices)


def test_bad_words_on_chat_streamed_and_not(client, server):
    tokenizer = server.engine.tokenizer
    vocab = server.engine.loaded.model_config.vocab_size
    free = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                          extra_body={"return_token_ids": True, "min_tokens": 12})
    tokens = free.choices[0].token_ids
    word = next(w for w in (tokenizer.decode(tokens[i:i + 1]).strip() for i in range(len(tokens))) if w
                and any(_contains(tokens, s) for s in bad_word_sequences(tokenizer, [w], vocab)))
    sequences = bad_word_sequences(tokenizer, [word], vocab)
    extra = {"return_token_ids": True, "min_tokens": 12, "bad_words": [word]}
    banned = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                            extra_body=extra)
    got = banned.choices[0].token_ids
    assert got != tokens and not any(_contains(got, s) for s in sequences)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, extra_body=extra))
    assert [t for chunk in chunks for c in chunk.choices for t in (getattr(c, "token_ids", None) or [])] == got
    assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices) == banned.choices[0].message.content


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, server):
    long = " ".join(["the water is cold"] * 200)  # (past the server's max_model_len of 512)
    ids = server.engine.tokenizer.encode(long)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=long, max_tokens=4)
    cut = client.completions.create(model="tiny", prompt=long, max_tokens=4, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 20})
    direct = client.completions.create(model="tiny", prompt=ids[-20:], max_tokens=4, temperature=0)
    assert cut.usage.prompt_tokens == 20 and cut.choices[0].text == direct.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long}], max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 30, "return_token_ids": True})
    assert chat.usage.prompt_tokens == 30 and len(chat.prompt_token_ids) == 30


@pytest.mark.parametrize("extra, param", [
    ({"allowed_token_ids": [1, 10 ** 6]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"truncate_prompt_tokens": 10 ** 6}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"bad_words": [""]}, "bad_words"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_values_are_400s_naming_the_field(client, extra, param, stream):
    for create in (lambda **kw: client.completions.create(prompt=PROMPT, **kw),
                   lambda **kw: client.chat.completions.create(messages=MESSAGES, **kw)):
        with pytest.raises(openai.BadRequestError) as bad:
            create(model="tiny", max_tokens=2, stream=stream, extra_body=extra)
        assert bad.value.body["param"] == param, bad.value.body
