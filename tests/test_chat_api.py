"""The web chat's API against the gateway in front of the bundled arith-gen + arith-prm (a real
treeserve server), on SQLite and PostgreSQL: sign-in and sessions, users kept apart, streamed
answers stored and billed, search and tools modes, Stop, exports. The browser test
(`test_chat_browser.py`) drives the same through the page."""
from __future__ import annotations

import io
import json
import threading
import time

import httpx
import openpyxl
import pytest

from chat_support import MASTER, add_user, arith_backend, chat_stack
from gateway_support import wait_for
from treeserve.gateway.chat.tools import ROUTER_PROMPT


@pytest.fixture(scope="module")
def backend():
    with arith_backend() as (url, tap):
        yield url, tap


@pytest.fixture(params=["sqlite", "postgresql"])
def stack(request, tmp_path, backend):
    database = f"sqlite:///{tmp_path / 'gateway.db'}" if request.param == "sqlite" \
        else request.getfixturevalue("postgres").new_database()
    with chat_stack(database, backend[0]) as (url, gateway, scripted, services):
        add_user(gateway, "ada", "correct horse battery")
        add_user(gateway, "bob", "another long password")
        yield url, gateway, scripted, services


def sign_in(url: str, user: str, password: str) -> httpx.Client:
    client = httpx.Client(base_url=url, timeout=120)
    response = client.post("/chat/api/login", json={"user_id": user, "password": password})
    assert response.status_code == 200, response.text
    client.headers["X-CSRF-Token"] = response.json()["csrf_token"]
    return client


def send(client: httpx.Client, conversation_id: str, content: str, **settings) -> list[dict]:
    """The page's events for one message."""
    body = {"content": content, **({"settings": settings} if settings else {})}
    with client.stream("POST", f"/chat/api/conversations/{conversation_id}/messages", json=body) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]


def new_conversation(client: httpx.Client, **settings) -> dict:
    response = client.post("/chat/api/conversations", json={"settings": settings} if settings else {})
    assert response.status_code == 200, response.text
    return response.json()


def test_sign_in_sessions_and_csrf(stack):
    url, gateway, _, _ = stack
    anonymous = httpx.Client(base_url=url, timeout=30)
    assert anonymous.get("/chat/api/conversations").status_code == 401
    page = anonymous.get("/chat")
    assert page.status_code == 200 and 'data-testid="login-submit"' in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert anonymous.post("/chat/api/login", json={"user_id": "ada", "password": "wrong"}).status_code == 401
    assert anonymous.post("/chat/api/login", json={"user_id": "nobody", "password": "x" * 10}).status_code == 401

    client = sign_in(url, "ada", "correct horse battery")
    cookie = client.cookies.jar._cookies  # noqa: SLF001 (the only way httpx shows a cookie's flags)
    session = next(c for domain in cookie.values() for path in domain.values() for c in path.values())
    assert session.has_nonstandard_attr("HttpOnly") and session.get_nonstandard_attr("SameSite") == "strict"
    stored = gateway.state.store.db.engine.connect().exec_driver_sql("SELECT token_hash FROM chat_sessions") \
        .scalars().all()
    assert session.value not in stored and len(stored) == 1  # the cookie itself is never stored

    csrf = client.headers.pop("X-CSRF-Token")
    refused = client.post("/chat/api/conversations", json={})
    assert refused.status_code == 403 and "X-CSRF-Token" in refused.json()["error"]["message"]
    client.headers["X-CSRF-Token"] = csrf
    assert client.post("/chat/api/conversations", json={}).status_code == 200
    assert client.post("/chat/api/logout").status_code == 200
    assert client.get("/chat/api/conversations").status_code == 401

    for _ in range(5):
        anonymous.post("/chat/api/login", json={"user_id": "bob", "password": "not it at all"})
    throttled = anonymous.post("/chat/api/login", json={"user_id": "bob", "password": "another long password"})
    assert throttled.status_code == 429 and int(throttled.headers["Retry-After"]) > 0
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {MASTER}"}).text
    assert 'treeserve_gateway:chat_sign_ins_total{outcome="throttled"} 1.0' in metrics
    assert 'treeserve_gateway:chat_sign_ins_total{outcome="refused"} 7.0' in metrics


def test_users_get_passwords_from_the_admin_api_and_the_cli(stack, tmp_path):
    url, gateway, _, _ = stack
    admin = {"Authorization": f"Bearer {MASTER}"}
    made = httpx.post(url + "/user/new", json={"user_id": "carol", "password": "carol's own passphrase"}, headers=admin)
    assert made.status_code == 200, made.text
    assert "password" not in made.text and "argon2" not in made.text
    stored = gateway.state.store.db.engine.connect().exec_driver_sql(
        "SELECT password_hash FROM users WHERE user_id = 'carol'").scalar()
    assert stored.startswith("$argon2id$") and "passphrase" not in stored
    sign_in(url, "carol", "carol's own passphrase")
    short = httpx.post(url + "/user/new", json={"user_id": "dave", "password": "short"}, headers=admin)
    assert short.status_code == 400 and short.json()["error"]["param"] == "password"
    assert httpx.post(url + "/user/new", json={"user_id": "eve", "password": "long enough!"}).status_code == 401

    from treeserve.cli import main
    database = gateway.state.store.db.url
    assert main(["gateway", "users", "create", "frank", "--password", "franks password", "--database", database]) == 0
    sign_in(url, "frank", "franks password")
    assert main(["gateway", "users", "set-password", "frank", "--password", "a new password", "--database",
                 database]) == 0
    sign_in(url, "frank", "a new password")


def test_conversations_are_listed_renamed_and_deleted(stack):
    url, *_ = stack
    client = sign_in(url, "ada", "correct horse battery")
    first, second = new_conversation(client), new_conversation(client, temperature=0.1)
    assert second["settings"]["temperature"] == 0.1 and second["settings"]["model"] == "arith-gen"
    renamed = client.patch(f"/chat/api/conversations/{first['id']}", json={"title": "  my   sums  "}).json()
    assert renamed["title"] == "my sums"
    listed = client.get("/chat/api/conversations").json()["conversations"]
    assert [c["id"] for c in listed] == [first["id"], second["id"]]  # the latest change first
    assert client.delete(f"/chat/api/conversations/{second['id']}").status_code == 200
    assert client.get(f"/chat/api/conversations/{second['id']}").status_code == 404
    assert [c["id"] for c in client.get("/chat/api/conversations").json()["conversations"]] == [first["id"]]
    page = client.get(f"/chat/c/{first['id']}")  # a conversation's own URL serves the page
    assert page.status_code == 200 and 'data-testid="message-input"' in page.text


def test_a_chat_is_streamed_stored_and_billed_to_its_user(stack, backend):
    url, gateway, _, _ = stack
    client = sign_in(url, "ada", "correct horse battery")
    conversation = new_conversation(client, temperature=0.0, max_tokens=24, system_prompt="You add numbers.")
    events = send(client, conversation["id"], "What is 2 + 3?")
    kinds = [e["type"] for e in events]
    assert kinds[0] == "user" and kinds[-1] == "done" and kinds.count("delta") > 2, kinds
    answer = events[-1]["message"]
    assert answer["content"] == "".join(e["text"] for e in events if e["type"] == "delta") != ""
    assert answer["completion_tokens"] > 0 and answer["prompt_tokens"] > 0
    upstream = [b for path, b in backend[1].bodies if path == "/v1/chat/completions"][-1]
    assert upstream["messages"][0] == {"role": "system", "content": "You add numbers."}
    assert upstream["temperature"] == 0.0 and upstream["max_tokens"] == 24

    stored = client.get(f"/chat/api/conversations/{conversation['id']}").json()
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
    assert stored["title"] == "What is 2 + 3?"
    gateway.state.store.ledger.flush()
    usage = client.get("/chat/api/me").json()["usage"]
    assert usage["completion_tokens"] == answer["completion_tokens"] and usage["cost"] > 0
    logs = httpx.get(url + "/spend/logs", params={"user_id": "ada"}, headers={"Authorization": f"Bearer {MASTER}"}).json()
    assert len(logs) == 1 and logs[0]["completion_tokens"] == answer["completion_tokens"]

    second = send(client, conversation["id"], "And 4 + 4?")  # the history goes along
    upstream = [b for path, b in backend[1].bodies if path == "/v1/chat/completions"][-1]
    assert [m["role"] for m in upstream["messages"]] == ["system", "user", "assistant", "user"]
    assert second[-1]["type"] == "done"


def test_a_message_too_long_for_the_context_is_kept_told_and_not_sent_again(stack, backend):
    # arith-gen's context is 512 tokens: with max tokens 8000 no message fits. The user sees why (with the
    # code the page acts on: it gives the text back to shorten), the message stays in the conversation
    # with its failed answer, nothing is generated, and the next message goes without it
    url, *_ = stack
    client = sign_in(url, "ada", "correct horse battery")
    conversation = new_conversation(client, max_tokens=8000)
    asked = len([b for path, b in backend[1].bodies if path == "/v1/chat/completions"])
    events = send(client, conversation["id"], "What is 2 + 3?")
    assert [e["type"] for e in events] == ["user", "error", "done"], events
    assert events[1]["code"] == "context_length_exceeded"
    told = events[1]["message"]
    assert "does not fit arith-gen's context of 512 tokens" in told and "None" not in told
    stored = client.get(f"/chat/api/conversations/{conversation['id']}").json()
    assert [(m["role"], m["content"]) for m in stored["messages"]] == [("user", "What is 2 + 3?"), ("assistant", "")]
    assert stored["messages"][1]["details"]["error"] == events[1]["message"] and stored["title"] == "What is 2 + 3?"
    assert len([b for path, b in backend[1].bodies if path == "/v1/chat/completions"]) == asked
    after = send(client, conversation["id"], "And 4 + 4?", max_tokens=8)
    upstream = [b for path, b in backend[1].bodies if path == "/v1/chat/completions"][-1]
    assert after[-1]["type"] == "done" and [m["content"] for m in upstream["messages"]] == ["And 4 + 4?"]


def test_users_are_kept_apart(stack):
    url, *_ = stack
    ada, bob = sign_in(url, "ada", "correct horse battery"), sign_in(url, "bob", "another long password")
    conversation = new_conversation(ada)
    send(ada, conversation["id"], "secret question", max_tokens=4)
    path = f"/chat/api/conversations/{conversation['id']}"
    for method, suffix, body in (("GET", "", None), ("PATCH", "", {"title": "mine"}), ("DELETE", "", None),
                                 ("POST", "/messages", {"content": "hi"}), ("GET", "/export?format=json", None)):
        response = bob.request(method, path + suffix, json=body)
        assert response.status_code == 404, (method, suffix, response.text)
        assert response.json()["error"]["code"] == "conversation_not_found"
    assert bob.get("/chat/api/conversations").json()["conversations"] == []
    exported = json.loads(bob.get("/chat/api/export?format=json").content)
    assert exported["conversations"] == []
    assert len(ada.get(path).json()["messages"]) == 2  # untouched


def test_search_mode_streams_progress_then_candidates_with_step_scores(stack):
    url, *_ = stack
    client = sign_in(url, "ada", "correct horse battery")
    conversation = new_conversation(client, mode="search", search_n=4, max_tokens=256)
    question = "Start with 12 and work modulo 100. Step 1: + 5. Step 2: * 3. What is the result?"
    events = send(client, conversation["id"], question)
    kinds = [e["type"] for e in events]
    assert "progress" in kinds and kinds[-1] == "done", kinds
    search = events[-1]["message"]["details"]["search"]
    assert search["verifier"] == "arith-prm" and len(search["candidates"]) == 4 and search["tree_size"] > 0
    assert all(c["step_scores"] and 0 <= c["score"] <= 1 for c in search["candidates"])
    assert events[-1]["message"]["content"] == search["candidates"][search["chosen"]]["text"]
    assert search["answer"] == search["candidates"][search["chosen"]]["answer"] != ""


def test_tools_mode_routes_the_conversation_and_runs_sympy(stack, backend):
    url, _, scripted, services = stack
    client = sign_in(url, "ada", "correct horse battery")
    conversation = new_conversation(client, mode="tools", model="arith-gen", max_tokens=16)
    events = send(client, conversation["id"], "solve x**2 - 5*x + 6 = 0 for x")
    tool = next(e for e in events if e["type"] == "tool")
    assert tool["name"] == "sympy" and tool["ok"] and tool["result"] == "[2, 3]"
    assert tool["input"] == {"operation": "solve", "expression": "x**2 - 5*x + 6 = 0", "variable": "x"}
    assert events[-1]["message"]["details"]["tool"]["result"] == "[2, 3]"

    events = send(client, conversation["id"], "integrate x*sin(x) for x")
    assert next(e for e in events if e["type"] == "tool")["result"] == "-x*cos(x) + sin(x)"
    events = send(client, conversation["id"], "evaluate 2^10 - 1 + sqrt(16)")
    assert next(e for e in events if e["type"] == "tool")["result"] == "1027"
    events = send(client, conversation["id"], "What is the weather like? Tell me a joke.")
    assert next(e for e in events if e["type"] == "routed")["tool"] == "answer_directly"
    router_request = scripted.state.requests[-1]
    # the conversation as the chat model sees it, tool answers left out (the scripted router cannot
    # measure it: all of it); it used to be the last message alone
    assert [m["content"] for m in router_request["messages"]] == [
        ROUTER_PROMPT, "solve x**2 - 5*x + 6 = 0 for x", "integrate x*sin(x) for x", "evaluate 2^10 - 1 + sqrt(16)",
        "What is the weather like? Tell me a joke."]
    assert {t["function"]["name"] for t in router_request["tools"]} == {"sympy", "weather", "wikipedia",
                                                                       "answer_directly"}
    answering = [b for path, b in backend[1].bodies if path == "/v1/chat/completions"][-1]
    contents = [m["content"] for m in answering["messages"]]
    assert not {"[2, 3]", "-x*cos(x) + sin(x)", "1027"} & set(contents)  # tool answers stripped
    assert contents[-1] == "What is the weather like? Tell me a joke."
    assert events[-1]["message"]["content"]

    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {MASTER}"}).text
    assert 'treeserve_gateway:chat_tool_calls_total{outcome="ok",tool="sympy"} 3.0' in metrics
    assert 'treeserve_gateway:chat_messages_total{mode="tools",status="done"} 4.0' in metrics
    weather = next(e for e in send(client, conversation["id"], "What is the weather in Lyon") if e["type"] == "tool")
    assert weather == {"type": "tool", "name": "weather", "input": {"location": "Lyon"}, "ok": True,
                       "result": "Lyon: 18 C, light rain"}
    wiki = next(e for e in send(client, conversation["id"], "look up Ada Lovelace") if e["type"] == "tool")
    assert wiki["name"] == "wikipedia" and wiki["result"] == "Ada Lovelace is the subject of a Wikipedia article."
    assert services.state.requests == [("weather", "Lyon"), ("wikipedia", "Ada Lovelace")]

    refused = send(client, conversation["id"], "evaluate __import__('os').system('true')")
    tool = next(e for e in refused if e["type"] == "tool")
    assert not tool["ok"] and "not allowed" in tool["result"]


def test_stop_keeps_the_partial_answer_and_aborts_upstream(stack, backend):
    url, gateway, _, _ = stack
    client = sign_in(url, "ada", "correct horse battery")
    conversation = new_conversation(client, max_tokens=400, temperature=1.0)
    got = []
    body = {"content": "Count slowly.", "settings": {"max_tokens": 400, "temperature": 1.0, "model": "arith-gen"}}
    with client.stream("POST", f"/chat/api/conversations/{conversation['id']}/messages", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and json.loads(line[5:])["type"] == "delta":
                got.append(json.loads(line[5:])["text"])
                if len(got) == 3:
                    break  # the client leaves (the Stop button aborts its fetch the same way)
    engine = backend[1].app.state.engine
    assert wait_for(lambda: not any(e.scheduler.has_unfinished() for e in engine.engines.values()), timeout=10)

    def stored():
        messages = client.get(f"/chat/api/conversations/{conversation['id']}").json()["messages"]
        return messages if len(messages) == 2 else None
    messages = wait_for(stored, timeout=10)
    assert messages and messages[1]["details"]["status"] == "stopped"
    assert messages[1]["content"].startswith("".join(got))
    gateway.state.store.ledger.flush()
    logs = httpx.get(url + "/spend/logs", params={"user_id": "ada"}, headers={"Authorization": f"Bearer {MASTER}"}).json()
    assert logs[0]["status"] == "client_closed" and 0 < logs[0]["completion_tokens"] < 400
    # the stopped reply keeps the tokens it was billed for (it asks for usage in every chunk)
    assert 0 < messages[1]["completion_tokens"] <= logs[0]["completion_tokens"], (messages[1], logs[0])


def test_exports_hold_every_message_and_never_a_formula(stack):
    url, *_ = stack
    client = sign_in(url, "ada", "correct horse battery")
    first = new_conversation(client, max_tokens=4)
    send(client, first["id"], "=HYPERLINK(\"http://evil.example\",\"click\")")
    second = new_conversation(client, max_tokens=4, temperature=0.3)
    send(client, second["id"], "Hello\x07 there")
    one = client.get(f"/chat/api/conversations/{first['id']}/export?format=xlsx")
    assert one.status_code == 200 and "attachment" in one.headers["content-disposition"]
    sheet = openpyxl.load_workbook(io.BytesIO(one.content)).active
    rows = list(sheet.iter_rows(values_only=True))
    assert rows[0][:5] == ("conversation_id", "conversation", "time", "role", "content")
    assert [r[3] for r in rows[1:]] == ["user", "assistant"]
    cell = sheet.cell(row=2, column=5)
    assert cell.data_type == "s" and cell.value.startswith("=HYPERLINK")  # text, not a formula

    every = openpyxl.load_workbook(io.BytesIO(client.get("/chat/api/export?format=xlsx").content)).active
    rows = list(every.iter_rows(values_only=True))[1:]
    assert len(rows) == 4 and {r[0] for r in rows} == {first["id"], second["id"]}
    assert json.loads(rows[2][7])["temperature"] == 0.3 and rows[3][9] > 0
    exported = client.get("/chat/api/export?format=json").json()
    assert [len(c["messages"]) for c in exported["conversations"]] == [2, 2]


def test_bad_input_gets_clear_errors(stack):
    url, *_ = stack
    client = sign_in(url, "ada", "correct horse battery")
    bad = client.post("/chat/api/conversations", json={"settings": {"temperature": 9}})
    assert bad.status_code == 400 and "temperature" in bad.text
    bad = client.post("/chat/api/conversations", json={"settings": {"model": "nope"}})
    assert bad.status_code == 400 and "nope" in bad.json()["error"]["message"]
    bad = client.post("/chat/api/conversations", json={"settings": {"model": "echo", "mode": "search"}})
    assert bad.status_code == 400 and "verifier" in bad.json()["error"]["message"]
    conversation = new_conversation(client)
    empty = client.post(f"/chat/api/conversations/{conversation['id']}/messages", json={"content": ""})
    assert empty.status_code == 400
    assert client.get("/chat/static/../store.py").status_code == 404
    nul = client.post(f"/chat/api/conversations/{conversation['id']}/messages", json={"content": "a\x00b"})
    assert nul.status_code == 400 and "NUL" in nul.text
    assert client.post("/chat/api/login", json={"user_id": "a\x00", "password": "x"}).status_code == 400


def test_a_session_and_its_conversations_are_the_same_on_every_gateway_process(stack):
    """Two gateways on one database (as two processes would be): signed in on one, served by the other."""
    from conftest import running_server
    from treeserve.gateway.app import build_app

    url, gateway, _, _ = stack
    client = sign_in(url, "ada", "correct horse battery")
    conversation = new_conversation(client, max_tokens=4)
    send(client, conversation["id"], "1 + 1")
    other = build_app(gateway.state.config)
    with running_server(other) as other_url:
        client.base_url = httpx.URL(other_url)
        mine = client.get(f"/chat/api/conversations/{conversation['id']}")
        assert mine.status_code == 200 and len(mine.json()["messages"]) == 2
        events = send(client, conversation["id"], "2 + 2")
        assert events[-1]["type"] == "done"
        assert client.post("/chat/api/logout").status_code == 200
    client.base_url = httpx.URL(url)
    assert client.get("/chat/api/conversations").status_code == 401  # signed out on both


def test_first_sign_ins_at_once_make_one_chat_key(stack):
    url, gateway, _, _ = stack
    add_user(gateway, "gina", "gina's long password")
    clients = [sign_in(url, "gina", "gina's long password") for _ in range(6)]
    threads = [threading.Thread(target=c.get, args=("/chat/api/me",)) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    keys = gateway.state.store.accounts.list_keys("gina")
    assert [k["key_alias"] for k in keys] == ["chat:gina"]


def test_the_chat_uses_its_own_key_never_an_admins_named_like_it(stack):
    """The chat found a user's key by the alias `chat:<user>`, so an admin's key with that alias was
    used (and billed) as the user's chat key. The admin API now refuses that prefix, and a key that
    holds such an alias from before is passed over: the chat's key is the one it made (web_chat)."""
    from sqlalchemy import select, update

    from treeserve.gateway.schema import ApiKey, SpendLog

    url, gateway, _, _ = stack
    store = gateway.state.store
    add_user(gateway, "ivy", "ivy's long password")
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {MASTER}"}, timeout=30)
    refused = admin.post("/key/generate", json={"key_alias": "chat:ivy", "user_id": "ivy"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "key_alias_reserved", refused.text
    tools = admin.post("/key/generate", json={"key_alias": "ivy-tools", "user_id": "ivy"})
    assert tools.status_code == 200, tools.text
    with store.db.transaction() as conn:  # (as an older gateway let an admin name it)
        conn.execute(update(ApiKey).where(ApiKey.id == tools.json()["key_id"]).values(key_alias="chat:ivy"))
    client = sign_in(url, "ivy", "ivy's long password")
    conversation = new_conversation(client, max_tokens=8)
    assert send(client, conversation["id"], "1+1")[-1]["type"] == "done"
    keys = {k["key_id"]: k for k in store.accounts.list_keys("ivy")}
    chat_key = next(k for i, k in keys.items() if i != tools.json()["key_id"])
    assert len(keys) == 2 and chat_key["metadata"] == {"purpose": "web chat"}

    def billed():  # (spend logs are written after the answer, by the gateway's writer)
        with store.db.session() as conn:
            return set(conn.scalars(select(SpendLog.key_id).where(SpendLog.user_id == "ivy")))
    assert wait_for(billed) == {chat_key["key_id"]}  # the message was billed to the chat's key


def test_concurrent_users_stream_at_once(stack):
    url, *_ = stack
    clients = [sign_in(url, "ada", "correct horse battery"), sign_in(url, "bob", "another long password")]
    results, threads = [], []
    for client in clients * 2:
        conversation = new_conversation(client, max_tokens=16)
        threads.append(threading.Thread(target=lambda c=client, i=conversation["id"]: results.append(send(c, i, "1+1"))))
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 4 and all(r[-1]["type"] == "done" for r in results), time.monotonic() - started


def test_the_chat_tells_its_users_a_model_is_down_without_the_backends_addresses():
    from treeserve.gateway.chat.upstream import error_message

    refusal = json.dumps({"error": {"code": "no_backend_available", "message": "model 'm': no backend could answer "
                          "(http://10.0.0.7:8000: ClientConnectorError (Cannot connect to host 10.0.0.7:8000))"}})
    told = error_message(refusal, 503)
    assert "10.0.0.7" not in told and "not available right now" in told
    assert error_message(json.dumps({"error": {"message": "max_budget: exceeded"}}), 400) == "max_budget: exceeded"
