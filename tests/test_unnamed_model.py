"""A chat, completion or response that names no `model` (vLLM's ChatCompletionRequest and
CompletionRequest take `model: str | None = None`, its served model meant): the server's one generator;
where several generate, a 400 naming `model` and listing them (the gateway, which routes by it,
always asks for it: test_agent_apis.py)."""
import httpx
import pytest

from conftest import running_server, wait_all_idle

CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5, "temperature": 0}
COMPLETION = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}


def _post(url: str, path: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("path, body, text", [("/v1/chat/completions", CHAT, lambda r: r["choices"][0]["message"]),
                                              ("/v1/completions", COMPLETION, lambda r: r["choices"][0]["text"])])
def test_a_body_without_model_is_the_served_generators(server, path, body, text):
    """Before: a 400 "model: Field required" (vLLM answers with its served model)."""
    unnamed = _post(server.url, path, body, server.key)
    assert unnamed.status_code == 200, unnamed.text
    named = _post(server.url, path, body | {"model": "tiny"}, server.key).json()
    assert unnamed.json()["model"] == "tiny" and text(unnamed.json()) == text(named)
    assert _post(server.url, path, body | {"model": None}, server.key).json()["model"] == "tiny"  # (null: left out)


def test_a_streamed_chat_without_model_names_the_served_one(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=CHAT | {"stream": True},
                      headers={"Authorization": f"Bearer {server.key}"}, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert lines and all('"model":"tiny"' in line.replace(" ", "") for line in lines)


def test_a_verifier_served_beside_the_generator_is_not_the_one_meant(bundled_pair_served):
    """gen and the prm (a verifier) served: a body without model is gen's."""
    url, app = bundled_pair_served
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                       ("/v1/responses", {"input": "Hello", "max_output_tokens": 4})):
        answer = _post(url, path, body)
        assert answer.status_code == 200 and answer.json()["model"] == "gen", (path, answer.text)
    wait_all_idle(app)


@pytest.fixture(scope="module")
def two_generators(llama_dir):
    from treeserve.server.launch import build_app

    app = build_app({"a": str(llama_dir), "b": str(llama_dir)}, dtype="float32", device="cpu",
                    kv_cache_memory_bytes=8 << 20, max_model_len=128)
    with running_server(app) as url:
        yield url, app
    app.state.runtime.close()


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                                        ("/v1/responses", {"input": "Hello"}),
                                        ("/v1/responses/input_tokens", {"input": "Hello"}),
                                        ("/v1/search", {"question": "2 + 2?", "system_prompt": "Be brief.",
                                                        "strategy": "majority", "n": 1, "max_tokens": 4}),
                                        ("/tokenize", {"messages": [{"role": "user", "content": "Hello"}]})])
def test_where_several_generate_a_body_without_model_is_a_400_listing_them(two_generators, path, body):
    """Which one is meant cannot be told: a 400 naming `model` and the served generators (before: chat
    and completions a bare "Field required"; a response, a search and /tokenize the first served
    model's, unasked: a search by it, and its tokenizer's and chat template's count, the chat then
    sent to another)."""
    url, app = two_generators
    refused = _post(url, path, body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "model" and error["code"] == "missing_required_parameter", error
    assert "2 generators are served (a, b)" in error["message"], error
    assert _post(url, path, body | {"model": "b"}).status_code == 200
    wait_all_idle(app)


def test_a_message_without_model_stays_a_400_as_anthropics(server):
    """Anthropic's Messages API requires `model`: so does the server's."""
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        refused = _post(server.url, path, {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
                        if path == "/v1/messages" else {"messages": [{"role": "user", "content": "Hi"}]}, server.key)
        assert refused.status_code == 400, refused.text
        assert refused.json()["type"] == "error" and "model" in refused.json()["error"]["message"], refused.text


@pytest.fixture(scope="module")
def verifier_listed_first():
    """The bundled pair served with the verifier named first ({prm, gen}): (base URL, app)."""
    from treeserve.server.launch import build_app

    app = build_app({"prm": "builtin:arith-prm", "gen": "builtin:arith-gen"}, dtype="float32", device="cpu",
                    kv_cache_memory_bytes=64 << 20)
    with running_server(app) as url:
        yield url, app
    app.state.runtime.close()


def test_a_search_without_model_is_the_generators_whatever_the_order_served(verifier_listed_first):
    """A search is a generation as a chat is: left out, its `model` is the one generator (before: the first
    served model, here the verifier, which then wrote the candidates it scored)."""
    url, app = verifier_listed_first
    body = {"verifier": "prm", "question": "Start with 3 and work modulo 100. Step 1: + 4. What is the result?",
            "strategy": "best_of_n", "n": 2, "max_tokens": 24}
    searched = _post(url, "/v1/search", body)
    assert searched.status_code == 200 and searched.json()["model"] == "gen", searched.text
    assert _post(url, "/v1/chat/completions", CHAT).json()["model"] == "gen"
    wait_all_idle(app)


def test_a_token_count_without_model_on_a_server_of_reward_models_only_is_the_first_served():
    """/tokenize serves reward models' prompts too: where none generates, the first served, as before."""
    from types import SimpleNamespace

    from treeserve.server.routes import ServedModels

    reward = SimpleNamespace(llm=SimpleNamespace(model_config=SimpleNamespace(head="reward")), model_name="rm")
    served = ServedModels({"rm": reward}, {})
    assert served.meant_serving(None) is reward and served.meant_serving("rm") is reward
