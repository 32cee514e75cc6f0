"""The example questions `treeserve chat` offers on the bundled models are ones they answer: the
chat example greedily, the search example by a beam search of 4 with the PRM (the chat page's
defaults); the gateway refuses examples it could not serve and shows each user only the models
their key allows."""
import pytest

from treeserve import LLM, SamplingParams
from treeserve.cli_chat import EXAMPLES
from treeserve.errors import ParamError
from treeserve.gateway.config import BackendConfig, ChatConfig, GatewayConfig, ModelConfig
from treeserve.runtime.runtime import Runtime
from treeserve.search.config import SearchConfig, declared_aggregation
from treeserve.search.grading import extract_answer, grade
from treeserve.search.runner import SearchRunner
from treeserve.tasks.arithmetic import parse_problem


def _example(mode: str) -> str:
    return next(e["text"] for e in EXAMPLES if e["mode"] == mode)


def test_the_chat_example_is_answered():
    question = _example("chat")
    llm = LLM("builtin:arith-gen", dtype="float32", device="cpu")
    out = llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=256),
                   use_tqdm=False)[0]
    assert grade(extract_answer(out.outputs[0].text), str(parse_problem(question).answer))


def test_the_search_example_is_answered():
    question = _example("search")
    rt = Runtime({"gen": "builtin:arith-gen", "prm": "builtin:arith-prm"}, dtype="float32", device="cpu",
                 kv_cache_memory_bytes=256 << 20)  # the default subtracts the test process's whole RSS
    config = SearchConfig(strategy="beam", n=4, beam_width=4, temperature=0.7, max_tokens=256, system_prompt=None,
                          agg_strategy=declared_aggregation(rt.engine("prm").model_dir), seed=0)
    result = SearchRunner(rt.engine("gen"), rt.scorer("prm")).run([question], config)[0]
    assert grade(result.pred, str(parse_problem(question).answer))


def _config(**chat) -> GatewayConfig:
    models = {name: ModelConfig(name, [BackendConfig("http://127.0.0.1:1")]) for name in ("gen", "prm")}
    return GatewayConfig(models=models, chat=ChatConfig(enabled=True, verifiers={"gen": "prm"}, **chat))


def test_the_gateway_checks_its_examples():
    assert _config(examples={"gen": EXAMPLES}).chat.examples["gen"] == EXAMPLES
    with pytest.raises(ParamError, match="model 'nope' is not configured"):
        _config(examples={"nope": EXAMPLES})
    with pytest.raises(ParamError, match="needs a mode"):
        _config(examples={"gen": [{"mode": "dance", "text": "x"}]})
    with pytest.raises(ParamError, match="needs a verifier"):
        _config(examples={"prm": [{"mode": "search", "text": "x"}]})


def test_each_user_sees_only_the_models_their_key_allows(tmp_path):
    """`/chat/api/me` (the page's model list, search models and examples) names only the models a
    user's key allows, and the chat refuses a message to any other."""
    import httpx

    from chat_support import add_user
    from conftest import running_server
    from treeserve.gateway.app import build_app

    chat_only = [e for e in EXAMPLES if e["mode"] == "chat"]
    models = {name: ModelConfig(name, [BackendConfig("http://127.0.0.1:1")]) for name in ("gen", "other", "prm")}
    config = GatewayConfig(models=models, master_key="sk-master", database=f"sqlite:///{tmp_path / 'gateway.db'}",
                           health_interval=0, chat=ChatConfig(enabled=True, verifiers={"gen": "prm"},
                                                              examples={"gen": EXAMPLES, "other": chat_only}))
    gateway = build_app(config)
    with running_server(gateway) as url:
        add_user(gateway, "everyone", "a long enough password")
        add_user(gateway, "other-only", "a long enough password", models=["other"])
        add_user(gateway, "gen-only", "a long enough password", models=["gen", "prm"])
        add_user(gateway, "no-verifier", "a long enough password", models=["gen", "other"])

        def me(user: str) -> tuple[httpx.Client, dict]:
            client = httpx.Client(base_url=url, timeout=30)
            login = client.post("/chat/api/login", json={"user_id": user, "password": "a long enough password"})
            assert login.status_code == 200, login.text
            client.headers["X-CSRF-Token"] = login.json()["csrf_token"]
            response = client.get("/chat/api/me")
            assert response.status_code == 200, response.text
            return client, response.json()

        _, everyone = me("everyone")
        assert everyone["models"] == ["gen", "other"] and everyone["search_models"] == ["gen"]
        assert set(everyone["examples"]) == {"gen", "other"}

        client, other_only = me("other-only")
        assert other_only["models"] == ["other"], other_only["models"]
        assert other_only["search_models"] == [] and set(other_only["examples"]) == {"other"}
        conversation = client.post("/chat/api/conversations", json={"settings": {"model": "other"}}).json()
        refused = client.post(f"/chat/api/conversations/{conversation['id']}/messages",
                              json={"content": "hi", "settings": {"model": "gen"}})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed", refused.text

        # a search needs the model's verifier too: not offered, and refused (before, offered, and its
        # refusal by the API, now LiteLLM's 401, would have read as the session's end on the page)
        client, no_verifier = me("no-verifier")
        assert no_verifier["models"] == ["gen", "other"] and no_verifier["search_models"] == [], no_verifier
        conversation = client.post("/chat/api/conversations", json={"settings": {"model": "gen"}}).json()
        refused = client.post(f"/chat/api/conversations/{conversation['id']}/messages",
                              json={"content": "1+1?", "settings": {"model": "gen", "mode": "search"}})
        assert refused.status_code == 403 and refused.json()["error"]["param"] == "settings.mode", refused.text
        assert "'prm'" in refused.json()["error"]["message"]

        _, gen_only = me("gen-only")
        assert gen_only["models"] == ["gen"] and gen_only["search_models"] == ["gen"], gen_only
        assert set(gen_only["examples"]) == {"gen"}
