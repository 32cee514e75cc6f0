"""Everyday parameters through the official `openai` client: logit_bias, continuous usage in
streams, models.retrieve, a 400 naming what is not implemented, and the OpenAPI schema."""
import re

import httpx
import openai
import pytest

from treeserve.wire.chat_completions import ChatCompletionRequest
from treeserve.wire.completions import CompletionRequest

MESSAGES = [{"role": "user", "content": "Tell me about the water"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.key, max_retries=0)


def test_logit_bias_steers_and_bans_tokens(client, server):
    greedy = client.completions.create(model="tiny", prompt="The water is", max_tokens=1, temperature=0, logprobs=1)
    first = greedy.choices[0].logprobs.tokens[0]
    token_id = server.engine.tokenizer.convert_tokens_to_ids(server.engine.tokenizer.tokenize(first))[0]
    banned = client.completions.create(model="tiny", prompt="The water is", max_tokens=1, temperature=0,
                                       logit_bias={str(token_id): -100})
    assert banned.choices[0].text != greedy.choices[0].text
    tokenizer = server.engine.tokenizer
    target = tokenizer.encode(" the", add_special_tokens=False)[0]
    forced = client.completions.create(model="tiny", prompt="The water is", max_tokens=3, temperature=1.0, seed=1,
                                       logit_bias={str(target): 100})
    assert forced.choices[0].text == tokenizer.decode([target] * 3)
    for key in ("abc", "²", "٣"):  # (superscript and Arabic-Indic digits: a 400 naming logit_bias, not int()'s text)
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="tiny", prompt="x", logit_bias={key: 1})
        assert bad.value.body["param"] == "logit_bias" and "token ids" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tiny", prompt="x", logit_bias={"10": 500})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, logit_bias={"99999999": 1})


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_counts_every_chunk(client, route):
    options = {"include_usage": True, "continuous_usage_stats": True}
    if route == "chat":
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, stream=True,
                                                     temperature=0, stream_options=options))
    else:
        chunks = list(client.completions.create(model="tiny", prompt="The water is", max_tokens=8, stream=True,
                                                temperature=0, stream_options=options))
    counted = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counted and counted == sorted(counted) and counted[-1] == 8
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    # every chunk has it, the chat's first (its role's) too, as vLLM's (it was null there)
    assert all(c.usage is not None and c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)


def test_a_null_is_a_field_left_out(client, server):
    """OpenAI's schema makes these nullable (a client sending a whole request object sends nulls);
    they were 400s. And stream_options without stream is a 400, as vLLM's (it was dropped)."""
    nulls = {"n": None, "presence_penalty": None, "frequency_penalty": None, "stream": None, "min_tokens": None,
             "ignore_eos": None, "skip_special_tokens": None, "priority": None, "logprobs": None,
             "parallel_tool_calls": None, "temperature": None, "seed": None, "stop": None}
    headers = {"Authorization": f"Bearer {server.key}"}
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "The"})):
        base = {"model": "tiny", "max_tokens": 4, "temperature": 0} | body
        plain = httpx.post(server.url + path, json=base, headers=headers, timeout=60)
        nulled = httpx.post(server.url + path, json=base | nulls | {"temperature": 0, "echo": None} if
                            path == "/v1/completions" else base | nulls | {"temperature": 0}, headers=headers,
                            timeout=60)
        assert nulled.status_code == 200, nulled.text
        assert nulled.json()["choices"][0] | {"index": 0} == plain.json()["choices"][0] | {"index": 0}
        unstreamed = httpx.post(server.url + path, json=base | {"stream_options": {"include_usage": True}},
                                headers=headers, timeout=60)
        assert unstreamed.status_code == 400 and unstreamed.json()["error"]["param"] == "stream_options"


def test_counts_and_offsets_as_vllms(client, server):
    """min_tokens protects its tokens' text from stop strings (vLLM: checked from token min_tokens + 1);
    a negative max_tokens is a 400 on completions too; a streamed completion's text_offset counts on
    across chunks; an error about max_completion_tokens names it (helper findings)."""
    tokenizer = server.engine.tokenizer
    target = tokenizer.encode(" the", add_special_tokens=False)[0]
    piece = tokenizer.decode([target])
    forced = client.completions.create(model="tiny", prompt="The water is", max_tokens=6, temperature=0,
                                       logit_bias={str(target): 100}, stop=[piece.strip()], extra_body={"min_tokens": 3})
    written, stop = piece * 4, piece.strip()  # the 4th token completes a stop string: cut where it starts
    cut = written.find(stop, len(written) - len(piece) - len(stop) + 1)
    assert forced.choices[0].text == written[:cut] and forced.usage.completion_tokens == 4
    assert len(written[:cut]) >= len(piece * 3)  # (the 3 protected tokens' text whole)
    with pytest.raises(openai.BadRequestError) as negative:
        client.completions.create(model="tiny", prompt="x", max_tokens=-5)
    assert negative.value.body["param"] == "max_tokens"
    whole = client.completions.create(model="tiny", prompt="The water is", max_tokens=8, temperature=0, logprobs=1)
    chunks = list(client.completions.create(model="tiny", prompt="The water is", max_tokens=8, temperature=0,
                                            logprobs=1, stream=True))
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=10 ** 6)
    assert too_many.value.body["param"] == "max_completion_tokens"
    assert too_many.value.body["message"].startswith("max_completion_tokens")


def test_models_retrieve(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("nope")


@pytest.mark.parametrize("extra, name", [({"functions": [{"name": "f"}]}, "functions"),
                                         ({"tool_choice": "required"}, "tool_choice"),  # with no tools
                                         ({"modalities": ["audio"]}, "modalities"),
                                         ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
                                         ({"guided_json": {"type": "object"}}, "guided_json"),  # (vLLM's older)
                                         ({"guided_choice": ["a", "b"]}, "guided_choice")])
def test_what_is_not_implemented_is_a_400_naming_it(client, extra, name):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert bad.value.body["param"] == name
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="tiny", prompt="x", best_of=3)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1, best_of=1).choices


def test_the_openapi_schema_comes_from_the_request_models(server):
    headers = {"Authorization": f"Bearer {server.key}"}
    assert httpx.get(f"{server.url}/openapi.json").status_code == 401  # auth rules unchanged
    schema = httpx.get(f"{server.url}/openapi.json", headers=headers).json()
    components = schema["components"]["schemas"]
    for path, model in [("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest)]:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model.__name__}"}
        assert set(components[model.__name__]["properties"]) == {f.alias or n for n, f in model.model_fields.items()}
        assert "400" in schema["paths"][path]["post"]["responses"]
    assert "/v1/models/{model_id}" in schema["paths"]
    docs = httpx.get(f"{server.url}/docs", headers=headers)
    assert docs.status_code == 200 and "openapi.json" in docs.text


def test_chat_template_kwargs_reach_the_template(llama_dir):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking, say) on chat completions and /tokenize;
    they were dropped (the field was ignored), and the request's own fields are not theirs to set."""
    from conftest import API_KEY, running_server
    from treeserve.model.random_models import CHAT_TEMPLATE
    from treeserve.server.launch import build_app

    app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], dtype="float32", device="cpu",
                    kv_cache_memory_bytes=8 << 20, max_model_len=256,
                    chat_template="{% if flag %}FLAG FLAG FLAG {% endif %}" + CHAT_TEMPLATE)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        headers = {"Authorization": f"Bearer {API_KEY}"}

        def prompt_tokens(**extra) -> tuple[int, int]:
            chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, extra_body=extra)
            counted = httpx.post(f"{url}/tokenize", headers=headers, json={"model": "tiny", "messages": MESSAGES} | extra)
            return chat.usage.prompt_tokens, counted.json()["count"]

        plain, flagged = prompt_tokens(), prompt_tokens(chat_template_kwargs={"flag": True})
        assert flagged[0] > plain[0] and flagged == (flagged[0], flagged[0]) and plain == (plain[0], plain[0])
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"tools": []}})
        assert bad.value.body["param"] == "chat_template_kwargs"


OVERFLOW = (r"This model's maximum context length is 512 tokens\. However, you requested {total} tokens "
            r"\({prompt} in the messages, {completion} in the completion\)\. "
            r"Please reduce the length of the messages or completion\.")


@pytest.mark.parametrize("route, extra, param, completion", [
    ("completions", {"prompt": [5] * 600}, "prompt", "16"),  # the prompt alone (and OpenAI's default max_tokens)
    ("completions", {"prompt": [5] * 600, "max_tokens": 20}, "prompt", "20"),
    ("completions", {"prompt": [5] * 500, "max_tokens": 20}, "max_tokens", "20"),  # with what it asks for
    ("chat", {"messages": [{"role": "user", "content": "water " * 600}]}, "messages", "1"),  # (one is generated)
    ("chat", {"messages": MESSAGES, "max_completion_tokens": 600}, "max_completion_tokens", "600"),
])
def test_a_context_overflow_is_openais_context_length_exceeded(client, route, extra, param, completion):
    """OpenAI's (and vLLM's) sentence and code, by which LiteLLM and LangChain detect an overflow; the
    parameter is still the one to change."""
    create = client.completions.create if route == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as overflow:
        create(model="tiny", **extra)
    body = overflow.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == param, body
    prompt = r"\d+" if route == "chat" else str(len(extra["prompt"]))
    total = r"\d+" if route == "chat" else str(len(extra["prompt"]) + int(completion))
    assert re.fullmatch(f"{param}: " + OVERFLOW.format(total=total, prompt=prompt, completion=completion),
                        body["message"]), body["message"]


def test_cors_only_for_the_allowed_origins_and_a_preflight_needs_no_key(llama_dir):
    """vLLM's --allowed-origins (a JSON list); by default no CORS headers at all (vLLM allows every
    origin by default: a page in the user's browser could then read a key-less local server)."""
    from conftest import API_KEY, running_server
    from treeserve.cli import build_parser
    from treeserve.server.launch import allow_cors, build_app

    args = build_parser().parse_args(["serve", "--allowed-origins", '["https://app.example"]'])
    assert args.allowed_methods == ["*"] and not args.allow_credentials
    app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], dtype="float32", device="cpu",
                    kv_cache_memory_bytes=8 << 20, max_model_len=256)
    allow_cors(app, args)
    with running_server(app) as url:
        preflight = httpx.options(f"{url}/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        listed = httpx.get(f"{url}/v1/models", headers={"Origin": "https://app.example",
                                                        "Authorization": f"Bearer {API_KEY}"})
        assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.get(f"{url}/v1/models", headers={"Origin": "https://evil.example",
                                                       "Authorization": f"Bearer {API_KEY}"})
        assert "access-control-allow-origin" not in other.headers
        assert httpx.get(f"{url}/v1/models", headers={"Origin": "https://app.example"}).status_code == 401
        # a page may read an answer's request id (Anthropic's `request-id`, vLLM's `X-Request-Id`): a
        # browser hides every header CORS does not expose (before: none was)
        import anthropic
        client = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0,
                                     default_headers={"Origin": "https://app.example"})
        raw = client.messages.with_raw_response.create(model="tiny", max_tokens=1,
                                                       messages=[{"role": "user", "content": "x"}])
        exposed = {name.strip().lower() for name in raw.headers["access-control-expose-headers"].split(",")}
        assert raw.headers["request-id"] and {"request-id", "x-request-id"} <= exposed, raw.headers


def test_request_id_headers_when_enabled(llama_dir):
    """vLLM's --enable-request-id-headers: every answer carries `X-Request-Id`, the request's own when it
    sent one, else a new uuid4 hex (the openai client's `_request_id`); streams and a refusal too."""
    from conftest import API_KEY, running_server
    from treeserve.cli import build_parser
    from treeserve.server.launch import build_app

    assert build_parser().parse_args(["serve", "--enable-request-id-headers"]).enable_request_id_headers
    assert not build_parser().parse_args(["serve"]).enable_request_id_headers
    app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], dtype="float32", device="cpu",
                    kv_cache_memory_bytes=8 << 20, max_model_len=256, request_id_headers=True)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        made = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert re.fullmatch(r"[0-9a-f]{32}", made._request_id), made._request_id
        again = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert again._request_id != made._request_id
        given = client.completions.create(model="tiny", prompt="The water is", max_tokens=2,
                                          extra_headers={"X-Request-Id": "trace-7"})
        assert given._request_id == "trace-7"
        with client.chat.completions.with_streaming_response.create(
                model="tiny", messages=MESSAGES, max_tokens=2, stream=True,
                extra_headers={"X-Request-Id": "stream-1"}) as stream:
            assert stream.headers.get_list("x-request-id") == ["stream-1"]
        refused = httpx.get(f"{url}/v1/models", headers={"X-Request-Id": "no-key"})
        assert refused.status_code == 401 and refused.headers["x-request-id"] == "no-key"
        message = httpx.post(f"{url}/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": MESSAGES},
                             headers={"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "msg-1"})
        assert message.status_code == 200 and message.headers["request-id"] == "msg-1"


def test_no_request_id_header_by_default(client):
    """Off by default, as in vLLM."""
    assert client.models.with_raw_response.list().headers.get("x-request-id") is None

def test_no_cors_headers_by_default(server):
    answer = httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://app.example",
                                                           "Authorization": f"Bearer {server.key}"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_chat_echo_puts_the_final_assistant_message_before_the_reply(client):
    """vLLM's chat `echo`: each choice's content starts with the final message's when that is the
    assistant's (a prefill), streamed as one chunk per choice after the role's; a final user message
    is not echoed. It was ignored (the content lacked the prefill)."""
    prefill = MESSAGES + [{"role": "assistant", "content": "The water"}]
    ending = {"add_generation_prompt": False, "continue_final_message": True}
    kwargs = dict(model="tiny", messages=prefill, max_tokens=4, temperature=0, n=2)
    plain = client.chat.completions.create(**kwargs, extra_body=ending)
    echoed = client.chat.completions.create(**kwargs, extra_body=ending | {"echo": True})
    assert [c.message.content for c in echoed.choices] == ["The water" + c.message.content for c in plain.choices]
    assert echoed.usage == plain.usage
    chunks = list(client.chat.completions.create(**kwargs, stream=True, extra_body=ending | {"echo": True}))
    for i, choice in enumerate(echoed.choices):
        deltas = [d.delta.content for c in chunks for d in c.choices if d.index == i]
        assert deltas[:2] == ["", "The water"] and "".join(d or "" for d in deltas) == choice.message.content
    unechoed = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                              extra_body={"echo": True})
    assert unechoed.choices[0].message.content == client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0).choices[0].message.content


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
def test_a_part_that_is_not_text_is_a_400_naming_its_type(client, part):
    """The models read text only: an image or audio part is a 400 that says so (it read "Input should
    be a valid string"); text parts still join."""
    content = [{"type": "text", "text": "Tell me"}, part]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=2)
    assert bad.value.body["param"] == "messages[0].content"
    assert f"part 1 is of type {part['type']!r}" in bad.value.body["message"]
    assert "only text parts" in bad.value.body["message"]
    assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content[:1]}],
                                          max_tokens=2).choices


def test_legacy_top_logprobs_hold_the_chosen_token_too(client):
    """OpenAI's legacy completions: "the API will always return the logprob of the sampled token, so
    there may be up to logprobs+1 elements" (vLLM's too). `logprobs: 0` gave null top_logprobs, and a
    token outside the top k was missing from its own."""
    zero = client.completions.create(model="tiny", prompt="The water is", max_tokens=4, temperature=0, logprobs=0)
    lp = zero.choices[0].logprobs
    assert lp.top_logprobs == [{t: p} for t, p in zip(lp.tokens, lp.token_logprobs)]
    echoed = client.completions.create(model="tiny", prompt="The water is the", max_tokens=0, echo=True, logprobs=1)
    lp = echoed.choices[0].logprobs
    assert lp.top_logprobs[0] is None
    for token, own, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == pytest.approx(own) and len(top) <= 2 and max(top.values()) >= own
    assert any(len(top) == 2 for top in lp.top_logprobs[1:])  # (a prompt token the model did not rank first)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_stream_options_include_obfuscation_is_taken(client, route):
    """OpenAI's `stream_options.include_obfuscation` (its reference lists it beside include_usage) was a
    400 "unknown parameter"; taken with no effect, as vLLM; a key no API has is still a 400 naming it."""
    create = (lambda **kw: client.chat.completions.create(messages=MESSAGES, **kw)) if route == "chat" else (
        lambda **kw: client.completions.create(prompt="The water is", **kw))
    chunks = list(create(model="tiny", max_tokens=3, stream=True, temperature=0,
                         stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as bad:
        create(model="tiny", max_tokens=3, stream=True, stream_options={"include_usages": True})
    assert bad.value.body["param"] == "stream_options.include_usages"


EFFORT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                   "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
                   "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
                   "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_reasoning_effort_is_a_chat_template_variable(llama_dir):
    """As vLLM: `reasoning_effort` goes to the chat template (gpt-oss's reads it), and with it
    `enable_thinking` (false for "none") unless chat_template_kwargs sets it; before: taken with no effect."""
    from conftest import API_KEY, running_server
    from treeserve.server.launch import build_app

    app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], dtype="float32", device="cpu",
                    kv_cache_memory_bytes=8 << 20, max_model_len=256, chat_template=EFFORT_TEMPLATE)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)

        def prompt(body: dict | None = None, **extra) -> str:
            out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                                 extra_body={"return_token_ids": True} | (body or {}), **extra)
            return httpx.post(f"{url}/detokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                              json={"model": "tiny", "tokens": out.prompt_token_ids}).json()["prompt"]
        assert "Reasoning" not in prompt() and "/no_think" not in prompt()
        assert "Reasoning: high\n<|assistant|>" in prompt(reasoning_effort="high")
        assert "Reasoning: none\n/no_think\n" in prompt(reasoning_effort="none")
        kept = prompt({"chat_template_kwargs": {"enable_thinking": True}}, reasoning_effort="none")
        assert "Reasoning: none\n<|assistant|>" in kept
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                           extra_body={"reasoning_effort": "extreme"})
        assert caught.value.body["param"] == "reasoning_effort", caught.value.body


def test_a_requests_own_chat_template_is_refused_by_name_or_rendered_when_trusted(llama_dir):
    """vLLM's per-request `chat_template` (chat completions, /tokenize): a 400 naming it unless the server
    was started with --trust-request-chat-template (vLLM's rule), then rendered in place of the model's,
    in Jinja's sandbox. Before: silently dropped (the model's template was used)."""
    from conftest import API_KEY, running_server
    from treeserve.server.launch import build_app

    own = "{% for m in messages %}OWN {{ m.content }} {% endfor %}"
    text = "".join(f"OWN {m['content']} " for m in MESSAGES)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for trusted in (False, True):
        app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], dtype="float32", device="cpu",
                        kv_cache_memory_bytes=8 << 20, max_model_len=256,
                        **({"trust_request_chat_template": True} if trusted else {}))  # (refused by default)
        with running_server(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)

            def tokenize(**body) -> httpx.Response:
                return httpx.post(f"{url}/tokenize", headers=headers, json={"model": "tiny"} | body)

            if not trusted:
                with pytest.raises(openai.BadRequestError) as bad:
                    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                                   extra_body={"chat_template": own})
                assert bad.value.body["param"] == "chat_template", bad.value.body
                assert "--trust-request-chat-template" in bad.value.body["message"]
                refused = tokenize(messages=MESSAGES, chat_template=own)
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
                continue
            expected = tokenize(prompt=text, add_special_tokens=False).json()["tokens"]
            assert tokenize(messages=MESSAGES, chat_template=own).json()["tokens"] == expected
            chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                                  extra_body={"chat_template": own})
            assert chat.usage.prompt_tokens == len(expected)
            escape = tokenize(messages=MESSAGES, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
            assert escape.status_code == 400 and escape.json()["error"]["param"] == "chat_template", escape.text
            assert "unsafe" in escape.json()["error"]["message"], escape.text  # (Jinja's sandbox refused it)


def test_a_requests_own_chat_template_that_fails_or_is_empty_is_named(llama_dir):
    """A trusted request's template that raises, or is empty: a 400 naming chat_template (was: one naming
    `messages`, which were fine, or, empty, `prompt: must not be empty`, a prompt the request never gave)."""
    from conftest import API_KEY, running_server
    from treeserve.server.launch import build_app

    app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], dtype="float32", device="cpu",
                    kv_cache_memory_bytes=8 << 20, max_model_len=256, trust_request_chat_template=True)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        for template, said in (("{{ raise_exception('no system role here') }}", "no system role here"),
                               ("", "empty template"), ("  ", "empty template")):
            with pytest.raises(openai.BadRequestError) as bad:
                client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                               extra_body={"chat_template": template})
            assert bad.value.body["param"] == "chat_template" and said in bad.value.body["message"], bad.value.body
