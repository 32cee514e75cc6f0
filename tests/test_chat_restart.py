"""Regenerate and Edit in the web chat's API, on SQLite and PostgreSQL (the fixtures of
test_chat_api.py): the last answer replaced by a new one, a user's message edited and sent again with
what followed it replaced, both stored (a reload shows them), an answer to a replaced question never
stored, and users kept apart on both routes. Tools mode's router sees the conversation windowed as
chat mode's model does. The browser test (`test_chat_browser.py`) drives the same through the page."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from chat_support import MASTER, add_user, chat_stack, stopped_answers
from gateway_support import wait_for
from test_chat_api import backend, new_conversation, send, sign_in, stack  # noqa: F401 (fixtures)
from treeserve.gateway.chat.tools import ROUTER_PROMPT
from treeserve.gateway.errors import QuestionReplaced


def restart(client: httpx.Client, method: str, path: str, body: dict | None = None) -> list[dict]:
    """The page's events for an edit or a regeneration."""
    with client.stream(method, path, json=body) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]


def stored(client: httpx.Client, conversation_id: str) -> list[tuple[str, str]]:
    messages = client.get(f"/chat/api/conversations/{conversation_id}").json()["messages"]
    return [(m["role"], m["content"]) for m in messages]


def echo_conversation(client: httpx.Client, *questions: str) -> dict:
    """A conversation answered by the scripted echo model (each answer is its question)."""
    conversation = new_conversation(client, model="echo")
    for question in questions:
        assert send(client, conversation["id"], question)[-1]["type"] == "done"
    return client.get(f"/chat/api/conversations/{conversation['id']}").json()


def test_regenerate_replaces_the_last_answer_and_stores_it(stack):
    url, _, scripted, _ = stack
    client = sign_in(url, "ada", "correct horse battery")
    conversation = echo_conversation(client, "first", "second")
    before = conversation["messages"]
    path = f"/chat/api/conversations/{conversation['id']}"
    events = restart(client, "POST", path + "/regenerate", {"settings": {"model": "echo", "max_tokens": 7}})
    assert [e["type"] for e in events][0] == "user" and events[-1]["type"] == "done"
    assert events[0]["message"]["content"] == "second" and events[-1]["message"]["content"] == "second"
    sent = scripted.state.requests[-1]
    assert [m["content"] for m in sent["messages"]] == ["first", "first", "second"]  # not the replaced answer
    assert sent["max_tokens"] == 7
    after = client.get(path).json()["messages"]
    assert [(m["role"], m["content"]) for m in after] == [("user", "first"), ("assistant", "first"),
                                                          ("user", "second"), ("assistant", "second")]
    assert [m["id"] for m in after[:2]] == [m["id"] for m in before[:2]]
    assert after[2]["id"] > before[3]["id"] and after[3]["id"] == events[-1]["message"]["id"]  # stored anew
    assert client.get(path).json()["settings"]["max_tokens"] == 7  # the settings it was regenerated with
    again = restart(client, "POST", path + "/regenerate")  # no body: the conversation's settings
    assert again[-1]["type"] == "done" and len(client.get(path).json()["messages"]) == 4
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {MASTER}"}).text
    assert 'treeserve_gateway:chat_restarts_total{action="regenerate"} 2.0' in metrics


def test_edit_sends_the_message_again_and_replaces_what_followed(stack):
    url, _, scripted, _ = stack
    client = sign_in(url, "ada", "correct horse battery")
    conversation = echo_conversation(client, "first", "second", "third")
    path = f"/chat/api/conversations/{conversation['id']}"
    second = conversation["messages"][2]["id"]
    events = restart(client, "PUT", f"{path}/messages/{second}", {"content": "second, edited"})
    assert events[0]["message"]["content"] == "second, edited" and events[-1]["type"] == "done"
    assert [m["content"] for m in scripted.state.requests[-1]["messages"]] == ["first", "first", "second, edited"]
    assert stored(client, conversation["id"]) == [("user", "first"), ("assistant", "first"),
                                                  ("user", "second, edited"), ("assistant", "second, edited")]
    first = conversation["messages"][0]["id"]
    restart(client, "PUT", f"{path}/messages/{first}", {"content": "only this"})
    assert [m["content"] for m in scripted.state.requests[-1]["messages"]] == ["only this"]
    assert stored(client, conversation["id"]) == [("user", "only this"), ("assistant", "only this")]
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {MASTER}"}).text
    assert 'treeserve_gateway:chat_restarts_total{action="edit"} 2.0' in metrics


def test_edit_and_regenerate_refuse_what_they_cannot_answer_again_and_change_nothing(stack):
    url, *_ = stack
    client = sign_in(url, "ada", "correct horse battery")
    empty = new_conversation(client, model="echo")
    nothing = client.post(f"/chat/api/conversations/{empty['id']}/regenerate", json={})
    assert nothing.status_code == 400 and "no message of yours" in nothing.json()["error"]["message"]
    conversation = echo_conversation(client, "kept")
    path = f"/chat/api/conversations/{conversation['id']}"
    answer = conversation["messages"][1]["id"]
    other = echo_conversation(client, "elsewhere")["messages"][0]["id"]
    for message_id, status, code in ((answer, 400, None), (other, 404, "message_not_found"),
                                     (10**12, 404, "message_not_found")):
        refused = client.put(f"{path}/messages/{message_id}", json={"content": "x"})
        assert refused.status_code == status and refused.json()["error"]["code"] == code, refused.text
    assert "only your own messages" in client.put(f"{path}/messages/{answer}", json={"content": "x"}).text
    first = conversation["messages"][0]["id"]
    assert client.put(f"{path}/messages/{first}", json={"content": ""}).status_code == 400
    assert client.put(f"{path}/messages/{first}", json={"content": "x", "settings": {"model": "nope"}}) \
        .status_code == 400
    assert client.put(f"{path}/messages/nine", json={"content": "x"}).status_code == 400
    csrf = client.headers.pop("X-CSRF-Token")  # the session's CSRF token, as every change
    assert client.put(f"{path}/messages/{first}", json={"content": "x"}).status_code == 403
    assert client.post(f"{path}/regenerate", json={}).status_code == 403
    client.headers["X-CSRF-Token"] = csrf
    assert stored(client, conversation["id"]) == [("user", "kept"), ("assistant", "kept")]  # untouched


def test_one_user_cannot_edit_or_regenerate_anothers_conversation(stack):
    url, *_ = stack
    ada, bob = sign_in(url, "ada", "correct horse battery"), sign_in(url, "bob", "another long password")
    conversation = echo_conversation(ada, "ada's secret")
    path = f"/chat/api/conversations/{conversation['id']}"
    question = conversation["messages"][0]["id"]
    for method, suffix, body in (("POST", "/regenerate", {}), ("PUT", f"/messages/{question}", {"content": "bob's"})):
        response = bob.request(method, path + suffix, json=body)
        assert response.status_code == 404 and response.json()["error"]["code"] == "conversation_not_found"
    # nor through a conversation of his own naming her message
    own = echo_conversation(bob, "bob's question")
    response = bob.put(f"/chat/api/conversations/{own['id']}/messages/{question}", json={"content": "bob's"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "message_not_found"
    assert stored(ada, conversation["id"]) == [("user", "ada's secret"), ("assistant", "ada's secret")]
    assert stored(bob, own["id"]) == [("user", "bob's question"), ("assistant", "bob's question")]
    anonymous = httpx.post(url + path + "/regenerate", json={})
    assert anonymous.status_code == 401


def test_an_answer_to_a_replaced_question_is_never_stored(stack):
    """An answer still streaming (or being saved as stopped) when its question is edited or regenerated
    is dropped, not stored after the new question; the new question's id is above every old one (SQLite
    hands out the highest id freed again, which would have matched the old question's)."""
    url, gateway, *_ = stack
    chats = gateway.state.chat.chats
    client = sign_in(url, "ada", "correct horse battery")
    conversation = echo_conversation(client, "question")
    old_question, old_answer = (m["id"] for m in conversation["messages"])
    question, history = chats.restart_at("ada", conversation["id"], None, None, model="echo")
    assert question["id"] > old_answer and history == []
    with pytest.raises(QuestionReplaced):
        chats.add_message("ada", conversation["id"], "assistant", "late", answers=old_question)
    chats.add_message("ada", conversation["id"], "assistant", "on time", answers=question["id"])
    assert stored(client, conversation["id"]) == [("user", "question"), ("assistant", "on time")]

    # through the API: an answer left streaming, then regenerated at once
    path = f"/chat/api/conversations/{conversation['id']}"
    body = {"content": "slowly: " + "one two three " * 8}
    stopped = stopped_answers(url)
    with client.stream("POST", path + "/messages", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and json.loads(line[5:])["type"] == "delta":
                break  # the page's Regenerate stops the answer streaming first
    restart(client, "POST", path + "/regenerate")
    assert wait_for(lambda: stopped_answers(url) == stopped + 1)  # the stopped answer's save was tried
    expected = [("user", "question"), ("assistant", "on time"), ("user", body["content"]),
                ("assistant", body["content"])]
    assert wait_for(lambda: stored(client, conversation["id"]) == expected, timeout=10), \
        stored(client, conversation["id"])


def test_tools_mode_routes_the_conversation_windowed_to_the_routers_context(stack, backend):
    """The router used to see only the last message; it sees the conversation as chat mode's model does
    (tool answers left out), the oldest turns left out until it fits the router's own context (here
    arith-router's 1024 tokens, its tools' descriptions about 590 of them) with its 256 tokens. (The
    bundled router itself, trained on single messages, is shown the last alone: test_chat_router.py.)"""
    url, gateway, *_ = stack
    with chat_stack(gateway.state.config.database, backend[0], router="fc-router") as (router_url, *_):
        client = sign_in(router_url, "ada", "correct horse battery")
        conversation = new_conversation(client, mode="tools", model="arith-gen", max_tokens=8)
        questions = [f"What is {i} * 23 + {i}? Please answer me quickly and exactly." for i in range(1, 8)]
        for question in questions:
            assert send(client, conversation["id"], question)[-1]["type"] == "done"
        routed = [b for path, b in backend[1].bodies if path == "/v1/chat/completions" and b.get("tools")]
        first, last = routed[-len(questions)], routed[-1]
        assert first["messages"] == [{"role": "system", "content": ROUTER_PROMPT},
                                     {"role": "user", "content": questions[0]}]
        assert last["messages"][0] == {"role": "system", "content": ROUTER_PROMPT}
        assert last["messages"][-1] == {"role": "user", "content": questions[-1]}
        messages = client.get(f"/chat/api/conversations/{conversation['id']}").json()["messages"]
        history = [m for m in messages[:-2] if m["role"] == "user" or ("tool" not in m["details"] and m["content"])]
        sent = last["messages"][1:]
        assert [m["content"] for m in sent[:-1]] == [m["content"] for m in history[len(history) - len(sent) + 1:]]
        assert messages[-1]["details"]["router_left_out"] == len(history) + 1 - len(sent) > 0

        def size(kept: list[dict]) -> int:  # as the router's server counts it, with the tools
            body = {"model": "arith-router", "messages": kept, "tools": last["tools"]}
            return httpx.post(backend[0] + "/tokenize", json=body).json()["count"]
        assert size(last["messages"]) + 256 <= 1024  # it fits, and one more turn would not have
        start = len(history) - (len(sent) - 1)  # where the window begins in the history
        turn = max(i for i in range(start) if history[i]["role"] == "user")  # the turn before it
        earlier = [{"role": m["role"], "content": m["content"]} for m in history[turn:start]]
        assert size(last["messages"][:1] + earlier + sent) + 256 > 1024


def test_a_restart_refused_at_admission_replaces_nothing(stack):
    """Regenerate (and Edit) whose new answer the model's server refuses (a full queue) before any of
    it came back: an HTTP error the page shows, and the conversation as it was, the old answer kept
    (was: the old answer deleted, and an empty failed answer stored in its place)."""
    url, _, scripted, _ = stack
    client = sign_in(url, "ada", "correct horse battery")
    conversation = echo_conversation(client, "first", "second")
    path = f"/chat/api/conversations/{conversation['id']}"
    scripted.state.queue_full = True
    try:
        regenerated = client.post(f"{path}/regenerate", json={})
        edited = client.put(f"{path}/messages/{conversation['messages'][2]['id']}", json={"content": "edited"})
    finally:
        scripted.state.queue_full = False
    for refused in (regenerated, edited):  # the server's refusal, as the page shows a refused request's
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full", refused.text
        assert "requests are waiting" in refused.json()["error"]["message"]
    after = client.get(path).json()
    assert after["messages"] == conversation["messages"]  # nothing replaced, nothing deleted
    events = restart(client, "POST", f"{path}/regenerate")  # admitted, it replaces the answer as before
    assert events[0]["type"] == "user" and events[-1]["message"]["content"] == "second"
    assert stored(client, conversation["id"]) == [("user", "first"), ("assistant", "first"),
                                                  ("user", "second"), ("assistant", "second")]
    # tools mode with a router the user's key may not use: the API's refusal (LiteLLM's 401) is the chat's
    # 403, which the page shows; a 401 would read as the session's end (the page signs out)
    add_user(stack[1], "cal", "cal's long password", models=["echo"])
    cal = sign_in(url, "cal", "cal's long password")
    conversation = echo_conversation(cal, "first")
    refused = cal.post(f"/chat/api/conversations/{conversation['id']}/regenerate",
                       json={"settings": {"model": "echo", "mode": "tools"}})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed", refused.text
    assert "Tried to access router" in refused.json()["error"]["message"], refused.text
    assert cal.get("/chat/api/me").status_code == 200  # (still signed in)
    assert stored(cal, conversation["id"]) == [("user", "first"), ("assistant", "first")]


def test_a_restart_left_before_its_answer_began_replaces_nothing(stack):
    """The page gone (Stop, a closed tab) while a Regenerate waits for its first output: the
    conversation as it was, the old answer kept (was: the restart stored once the new answer began, no
    one there to read it: the old answer replaced by the new one's first piece, stored as stopped)."""
    url, _, scripted, _ = stack
    client = sign_in(url, "ada", "correct horse battery")
    conversation = echo_conversation(client, "first", "slowly: second")  # (its first output after 0.2 s)
    path = f"/chat/api/conversations/{conversation['id']}"
    asked = len(scripted.state.requests)
    with pytest.raises(httpx.ReadTimeout):
        client.post(f"{path}/regenerate", json={}, timeout=httpx.Timeout(120, read=0.05))
    assert wait_for(lambda: len(scripted.state.requests) > asked)  # the new answer was asked for
    time.sleep(1.0)  # (its first output comes after 0.2 s: what the gateway does then is done by now)
    assert stored(client, conversation["id"]) == [("user", "first"), ("assistant", "first"),
                                                  ("user", "slowly: second"), ("assistant", "slowly: second")]
    assert client.get(path).json()["messages"] == conversation["messages"]
