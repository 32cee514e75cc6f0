"""The real server driven by the official `openai` client (sync and async)."""
import asyncio

import openai
import pytest

from conftest import assert_no_leak, wait_idle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0)


@pytest.fixture(scope="module")
def async_client(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0)


MESSAGES = [{"role": "user", "content": "Tell me about the water and the people who live near it, and how they make their time"}]


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_model_cards_are_vllms(client, llama_dir):
    """vLLM's card fields: root (what the model was loaded from), parent, one permission object."""
    card = client.models.retrieve("tiny").model_dump()
    assert card["root"] == str(llama_dir) and card["parent"] is None and card["owned_by"] == "treeserve"
    assert card["max_model_len"] == 512
    [permission] = card["permission"]
    assert permission["id"].startswith("modelperm-") and permission["object"] == "model_permission"
    assert permission["created"] == card["created"] and permission["organization"] == "*"
    assert (permission["allow_sampling"], permission["allow_logprobs"], permission["allow_view"]) == (True,) * 3
    assert not any(permission[k] for k in ("allow_create_engine", "allow_search_indices", "allow_fine_tuning",
                                           "is_blocking"))
    assert permission["group"] is None
    assert client.models.list().data[0].model_dump() | {"permission": None} == card | {"permission": None}


def test_chat_non_streaming_with_usage(client, server):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0
    again = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prompt's full blocks were cached


def test_streamed_text_equals_non_streamed(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=24, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full
    assert usage is not None and usage.completion_tokens == 24 and finish == "length"


def test_n_and_seeds_reproduce(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=1.0, seed=5, n=2)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert len(first.choices) == 2 and [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the top token


def test_chat_logprobs_bytes_join_into_the_characters_tokens_split(client):
    """OpenAI's `bytes` are each token's own: a token holding part of a multi-byte character decodes
    alone to U+FFFD, and only its real bytes joined with its neighbours' give the character back."""
    text = "h\u00e9llo \U0001F600"  # (the tiny tokenizer spells each of their bytes as a token)
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"structured_outputs": {"regex": text}})
    content = resp.choices[0].logprobs.content
    assert resp.choices[0].message.content == text
    assert any(entry.token == "\ufffd" for entry in content)  # the case this is about
    assert b"".join(bytes(entry.bytes) for entry in content).decode("utf-8") == text
    for entry in content:
        assert all(candidate.bytes for candidate in entry.top_logprobs)


def test_stop_strings_over_http(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = text[4:7]
    cut = client.chat.completions.create(stop=[stop], **kwargs)
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stop=[stop], stream=True, **kwargs) if c.choices)
    assert streamed == text[: text.index(stop)]


def test_completions_prompt_forms(client, server):
    tokenizer = server.engine.tokenizer
    ids = tokenizer.encode("The water is")
    single = client.completions.create(model="tiny", prompt="The water is", max_tokens=6, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    many = client.completions.create(model="tiny", prompt=["The water is", "Hello"], max_tokens=6, temperature=0, n=2)
    assert single.choices[0].text == by_ids.choices[0].text
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == single.choices[0].text
    echo = client.completions.create(model="tiny", prompt="The water is", max_tokens=6, temperature=0, echo=True)
    assert echo.choices[0].text == "The water is" + single.choices[0].text
    lp = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.tokens) == 4 and len(lp.choices[0].logprobs.top_logprobs[0]) == 2


def test_completions_stream(client):
    kwargs = dict(model="tiny", prompt="Hello there", max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == full


def test_return_token_ids_gives_the_prompts_and_the_generated_ids_as_vllms(client, server):
    """vLLM's `return_token_ids` (sent with extra_body): a completion's choices carry `prompt_token_ids` and
    `token_ids`, a chat reply `prompt_token_ids` and each choice `token_ids`; streamed, the prompt's come
    in the first chunk (a completion choice's first) and each chunk carries its new ids (it was ignored)."""
    import httpx

    tokenizer, ask = server.engine.tokenizer, {"extra_body": {"return_token_ids": True, "ignore_eos": True}}
    kwargs = dict(model="tiny", prompt="The water is", max_tokens=6, temperature=0)
    whole = client.completions.create(**kwargs, **ask)
    [choice] = whole.choices
    assert choice.prompt_token_ids == tokenizer.encode("The water is")
    assert len(choice.token_ids) == whole.usage.completion_tokens == 6
    assert tokenizer.decode(choice.token_ids) == choice.text
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs, **ask) if c.choices]
    assert chunks[0].prompt_token_ids == choice.prompt_token_ids
    assert all(c.prompt_token_ids is None for c in chunks[1:])
    assert [i for c in chunks for i in c.token_ids] == choice.token_ids
    plain = client.completions.create(**kwargs).choices[0]
    assert getattr(plain, "token_ids", None) is None and getattr(plain, "prompt_token_ids", None) is None

    chat = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    reply = client.chat.completions.create(**chat, **ask)
    rendered = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES},
                          headers={"Authorization": f"Bearer {server.key}"}).json()["tokens"]
    assert reply.prompt_token_ids == rendered and len(rendered) == reply.usage.prompt_tokens
    [message] = reply.choices
    assert len(message.token_ids) == reply.usage.completion_tokens == 8
    assert tokenizer.decode(message.token_ids) == message.message.content
    streamed = list(client.chat.completions.create(stream=True, **chat, **ask))
    assert streamed[0].prompt_token_ids == rendered
    assert all(getattr(c, "prompt_token_ids", None) is None for c in streamed[1:])
    assert [i for c in streamed[1:] for ch in c.choices for i in ch.token_ids] == message.token_ids
    assert getattr(client.chat.completions.create(**chat), "prompt_token_ids", None) is None


def test_async_client(async_client, server):
    async def run():
        tasks = [async_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
                 for _ in range(4)]
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert len({r.choices[0].message.content for r in results}) == 1
    wait_idle(server.engine)
    assert_no_leak(server.engine)


def test_tokenize_detokenize(server):
    import httpx

    headers = {"Authorization": f"Bearer {server.key}"}
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "café 😀"}, headers=headers).json()
    assert tokens["count"] == len(tokens["tokens"])
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()
    assert text["prompt"] == "café 😀"
    assert httpx.get(f"{server.url}/version", headers=headers).json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_tokenize_returns_the_token_strings_when_asked(server):
    """vLLM's return_token_strs: token_strs are the tokens' vocabulary pieces (null unless asked)."""
    import httpx

    headers = {"Authorization": f"Bearer {server.key}"}
    asked = httpx.post(f"{server.url}/tokenize", json={"prompt": "The water is", "return_token_strs": True},
                       headers=headers).json()
    assert asked["token_strs"] == server.engine.tokenizer.convert_ids_to_tokens(asked["tokens"])
    assert "".join(asked["token_strs"]).replace("\u0120", " ").endswith("The water is")  # (byte-level: Ġ is a space)
    assert len(asked["token_strs"]) == asked["count"] and all(isinstance(s, str) for s in asked["token_strs"])
    chat = httpx.post(f"{server.url}/tokenize", headers=headers, json={
        "messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True}).json()
    assert len(chat["token_strs"]) == chat["count"]
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "Hi"}, headers=headers).json()["token_strs"] is None


def test_tokenize_messages_honour_add_special_tokens_as_vllms(server):
    """vLLM's /tokenize for messages: add_special_tokens defaults to false (the chat template writes its
    own BOS) and true adds the tokenizer's on top; a prompt's defaults to true. With a tokenizer that adds
    a BOS, messages sent with add_special_tokens: true were tokenized as without it."""
    import httpx
    from tokenizers.processors import TemplateProcessing

    headers, tokenizer = {"Authorization": f"Bearer {server.key}"}, server.engine.tokenizer
    backend, bos = tokenizer.backend_tokenizer, tokenizer.bos_token_id
    before = backend.post_processor
    backend.post_processor = TemplateProcessing(single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, bos)])
    try:
        def tokens(**body):
            return httpx.post(f"{server.url}/tokenize", headers=headers, json=body).json()["tokens"]

        chat = tokens(messages=MESSAGES)
        assert chat[0] == bos and chat[1] != bos  # the template's BOS only
        assert tokens(messages=MESSAGES, add_special_tokens=False) == chat
        assert tokens(messages=MESSAGES, add_special_tokens=True) == [bos] + chat
        assert tokens(prompt="The water is") == [bos] + tokens(prompt="The water is", add_special_tokens=False)
        ended = tokens(messages=MESSAGES, add_generation_prompt=False)
        assert len(ended) < len(chat) and chat[:len(ended)] == ended  # (no assistant header)
        assert tokens(messages=MESSAGES, add_generation_prompt=False, add_special_tokens=True) == [bos] + ended
    finally:
        backend.post_processor = before


def test_ping_is_health_for_sagemaker(server):
    """vLLM's /ping (GET and POST): 200 as /health, with no API key, as /health."""
    import httpx

    for method in ("GET", "POST"):
        assert httpx.request(method, f"{server.url}/ping").status_code == 200
    assert httpx.get(f"{server.url}/v1/models").status_code == 401  # (the key is needed elsewhere)
