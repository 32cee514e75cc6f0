"""The reward endpoints for search frameworks that run their own tree search, on the bundled pair:
vLLM's /pooling (a conversation in, a score per step out, split at the PRM's step separator) equals
the step scores /v1/search reports for the same steps; /v1/score scores candidate continuations of
one prefix in one call, each equal to /v1/rewards of the whole solution; bad input is a 400 naming
the field, and nothing is left running."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from conftest import wait_all_idle

QUESTION = "Start with 40 and work modulo 100. Step 1: - 5. Step 2: + 17. What is the result?"


def test_pooling_step_scores_equal_the_searchs(bundled_pair_served):
    url, _ = bundled_pair_served
    search = httpx.post(f"{url}/v1/search", json={"model": "gen", "verifier": "prm", "question": QUESTION,
                                                  "strategy": "best_of_n", "n": 4, "seed": 3}, timeout=300).json()
    checked = 0
    for candidate in search["candidates"]:
        pooled = httpx.post(f"{url}/pooling", timeout=60, json={"model": "prm", "messages": [
            {"role": "user", "content": QUESTION}, {"role": "assistant", "content": candidate["text"]}]})
        assert pooled.status_code == 200, pooled.text
        body = pooled.json()
        assert body["object"] == "list" and body["data"][0]["object"] == "pooling"
        assert body["usage"]["prompt_tokens"] > 0
        assert body["data"][0]["data"] == pytest.approx(candidate["step_scores"], abs=1e-5)
        checked += len(candidate["step_scores"])
    assert checked >= 8


def test_score_scores_every_candidate_of_one_prefix_as_rewards_would(bundled_pair_served):
    url, app = bundled_pair_served
    prefix = ["Start: 40.", "Step 1: 40 - 5 = 35."]
    candidates = ["Step 2: 35 + 17 = 52.", "Step 2: 35 + 17 = 53.", ["Step 2: 35 + 17 = 52.", "The answer is 52."]]
    scored = httpx.post(f"{url}/v1/score", json={"model": "prm", "question": QUESTION, "steps": prefix,
                                                 "candidates": candidates}, timeout=60)
    assert scored.status_code == 200, scored.text
    body = scored.json()
    for i, candidate in enumerate(candidates):
        steps = prefix + ([candidate] if isinstance(candidate, str) else candidate)
        rewards = httpx.post(f"{url}/v1/rewards", json={"model": "prm", "question": QUESTION, "steps": steps},
                             timeout=60).json()["scores"]
        assert body["data"][i]["index"] == i
        assert body["data"][i]["scores"] == pytest.approx(rewards[len(prefix):], abs=1e-5)
        assert body["data"][i]["score"] == pytest.approx(rewards[-1], abs=1e-5)
        assert body["prefix_scores"] == pytest.approx(rewards[:len(prefix)], abs=1e-5)
    wait_all_idle(app)
    for engine in app.state.engine.engines.values():
        assert not engine.scheduler.has_unfinished()


def test_a_solution_scores_the_same_however_its_steps_are_spaced(bundled_pair_served):
    """/pooling splits as a search does (stripped, empty pieces dropped) and /v1/rewards and /v1/score
    strip given steps: before, a third newline or a trailing one turned a step's 0.997 into 1e-9,
    and four newlines made an empty step (a helper's finding)."""
    url, _ = bundled_pair_served
    steps = ["Start: 40.", "Step 1: 40 - 5 = 35.", "Step 2: 35 + 17 = 52."]
    clean = httpx.post(f"{url}/v1/rewards", json={"model": "prm", "question": QUESTION, "steps": steps},
                       timeout=60).json()["scores"]
    for text in ("\n\n".join(steps), "\n\n\n".join(steps), "\n\n\n\n".join(steps) + "\n\n",
                 "  " + " \n\n  ".join(steps) + "  "):
        pooled = httpx.post(f"{url}/pooling", timeout=60, json={"model": "prm", "messages": [
            {"role": "user", "content": QUESTION}, {"role": "assistant", "content": text}]}).json()
        assert pooled["data"][0]["data"] == pytest.approx(clean, abs=1e-5), repr(text)
    spaced = httpx.post(f"{url}/v1/rewards", json={"model": "prm", "question": QUESTION,
                                                   "steps": [s + "\n\n" for s in steps]}, timeout=60).json()
    assert spaced["scores"] == pytest.approx(clean, abs=1e-5)
    scored = httpx.post(f"{url}/v1/score", json={"model": "prm", "question": QUESTION, "steps": steps[:2],
                                                 "candidates": [" " + steps[2] + "\n"]}, timeout=60).json()
    assert scored["data"][0]["score"] == pytest.approx(clean[2], abs=1e-5)


def test_pooling_base64_decodes_to_the_float_scores(bundled_pair_served):
    """vLLM's encoding_format: "base64" is the base64 of the little-endian float32 scores; before, it
    was dropped and the floats came back (a client decoding base64 failed on a list)."""
    url, _ = bundled_pair_served
    body = {"model": "prm", "messages": [{"role": "user", "content": QUESTION},
                                         {"role": "assistant", "content": "Start: 40.\n\nStep 1: 40 - 5 = 35."}]}
    floats = httpx.post(f"{url}/pooling", json=body, timeout=60).json()
    packed = httpx.post(f"{url}/pooling", json={**body, "encoding_format": "base64"}, timeout=60).json()
    assert isinstance(packed["data"][0]["data"], str) and packed["usage"] == floats["usage"]
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), dtype="<f4").tolist()
    assert len(decoded) == 2 and decoded == pytest.approx(floats["data"][0]["data"], rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rewards", {"model": "prm", "question": "q", "steps": ["a", " \n"]}, "steps[1]"),
    ("/v1/score", {"model": "prm", "question": "q", "steps": [""], "candidates": ["a"]}, "steps[0]"),
    ("/v1/score", {"model": "prm", "question": "q", "candidates": [["a", ""]]}, "candidates[0][1]"),
    ("/v1/rewards", {"model": "prm", "question": "q", "steps": ["a"], "step": ["b"]}, "step"),
    ("/v1/search", {"model": "gen", "verifier": "prm", "question": "q", "max_iterations": 1}, "max_iterations"),
    ("/v1/score", {"model": "prm", "question": "q", "candidates": []}, "candidates"),
    ("/v1/score", {"model": "prm", "question": "q", "candidates": [[]]}, "candidates[0]"),
    ("/v1/score", {"model": "nope", "question": "q", "candidates": ["a"]}, "model"),
    ("/pooling", {"model": "prm", "messages": [{"role": "system", "content": "s"},
                                               {"role": "user", "content": "q"}]}, "messages"),
    ("/pooling", {"model": "prm", "messages": [{"role": "user", "content": "q"}]}, "messages"),
    ("/pooling", {"model": "prm", "messages": [{"role": "user", "content": "q"},
                                               {"role": "assistant", "content": "\n\n"}]}, "messages[1].content"),
    ("/pooling", {"model": "prm", "messages": [{"role": "user", "content": "q"},
                                               {"role": "assistant", "content": "a"}], "dimensions": 3}, "dimensions"),
    ("/pooling", {"model": "prm", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                  "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ("/pooling", {"model": "prm", "input": "q a"}, "input"),
    ("/pooling", {"model": "prm", "messages": [{"role": "user", "content": QUESTION * 40},  # (was "steps")
                                               {"role": "assistant", "content": "Start: 40."}]}, "messages"),
    ("/v1/rewards", {"model": "prm", "question": QUESTION * 40, "steps": ["Start: 40."]}, "steps"),
    ("/pooling", {"model": "prm", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                  "encoding_format": "bytes"}, "encoding_format"),
    ("/pooling", {"model": "prm", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                  "encoding_format": "base64", "embed_dtype": "float16"}, "embed_dtype"),
])
def test_bad_scoring_requests_are_400s_naming_the_field(bundled_pair_served, path, body, param):
    url, app = bundled_pair_served
    response = httpx.post(url + path, json=body, timeout=30)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param
    wait_all_idle(app)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rewards", {"model": "gen", "question": QUESTION, "steps": ["Start: 40."]}, "model"),
    ("/v1/score", {"model": "gen", "question": QUESTION, "candidates": ["Start: 40."]}, "model"),
    ("/pooling", {"model": "gen", "messages": [{"role": "user", "content": QUESTION},
                                              {"role": "assistant", "content": "Start: 40."}]}, "model"),
    ("/v1/search", {"model": "gen", "verifier": "gen", "question": QUESTION, "strategy": "beam", "n": 4}, "verifier"),
    ("/v1/search", {"model": "gen", "verifier": "gen", "question": QUESTION, "strategy": "greedy"}, "verifier"),
])
def test_the_generator_is_not_accepted_as_a_verifier(bundled_pair_served, path, body, param):
    """A plain language model whose config names no recipe is no verifier: before, RLHFlow's recipe
    read `+`/`-` logits the generator never learnt and answered 200 with near-constant scores."""
    url, app = bundled_pair_served
    response = httpx.post(url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "model_not_a_verifier"
    assert "'gen' is not served as a verifier (served verifiers: prm)" in error["message"]
    assert "--verifier NAME[=RECIPE]" in error["message"]
    wait_all_idle(app)


def _conversation(question) -> dict:
    return {"model": "prm", "messages": [{"role": "user", "content": question},
                                         {"role": "assistant", "content": "Start: 40."}]}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rewards", {"model": "prm", "question": "", "steps": ["Start: 40."]}, "question"),
    ("/v1/rewards", {"model": "prm", "question": " \n\t", "steps": ["Start: 40."]}, "question"),
    ("/pooling", _conversation(""), "messages[0].content"),
    ("/pooling", _conversation(None), "messages[0].content"),
    ("/pooling", _conversation([]), "messages[0].content"),
    ("/pooling", _conversation([{"type": "text", "text": " "}, {"type": "text", "text": ""}]), "messages[0].content"),
])
def test_an_empty_question_is_a_400_naming_it(bundled_pair_served, path, body, param):
    """As on /score, /v1/score and /v1/search: the step scores of an answer to no question say nothing
    (an unset variable in a client's script, say). Before, /v1/rewards and /pooling answered 200 with
    scores of the steps alone."""
    url, app = bundled_pair_served
    response = httpx.post(url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] == f"{param}: the question is empty", error
    wait_all_idle(app)


UNNAMED = [  # (path, a body that names no model): vLLM's pooling and score bodies may leave `model` out
    ("/v1/rewards", {"question": QUESTION, "steps": ["Start: 40.", "Step 1: 40 - 5 = 35."]}),
    ("/pooling", {"messages": _conversation(QUESTION)["messages"]}),
    ("/v1/score", {"question": QUESTION, "steps": ["Start: 40."], "candidates": ["Step 1: 40 - 5 = 35."]}),
    ("/score", {"question": QUESTION, "candidates": [["Start: 40.", "Step 1: 40 - 5 = 35."]]}),
]


@pytest.mark.parametrize("path, body", UNNAMED)
def test_a_body_without_model_scores_with_the_served_reward_model(bundled_pair_served, path, body):
    """As vLLM's (its pooling and score requests' `model` is optional: the served model): the one reward
    model served. Before, /v1/rewards, /pooling and treeserve's /v1/score body were a 400 "model: Field
    required" (vLLM's /score body alone took it left out)."""
    url, app = bundled_pair_served
    unnamed = httpx.post(url + path, json=body, timeout=60)
    assert unnamed.status_code == 200, unnamed.text
    named = httpx.post(url + path, json={"model": "prm"} | body, timeout=60).json()
    assert unnamed.json()["model"] == "prm"
    assert unnamed.json()["data" if "data" in named else "scores"] == named["data" if "data" in named else "scores"]
    wait_all_idle(app)


@pytest.mark.parametrize("path, body", UNNAMED)
def test_a_body_without_model_on_a_server_of_no_reward_model_is_a_400_naming_it(server, path, body):
    """Where no reward model is served, `model` cannot be guessed: a 400 naming it, with the code naming the
    served model gets (`model_not_a_verifier`), as a chat's without model on a server of reward models only
    (test_reward_heads.py); it was `missing_required_parameter`, "this field is required", as if a reward
    model were there to name."""
    headers = {"Authorization": f"Bearer {server.key}"}
    response = httpx.post(server.url + path, json=body, headers=headers, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "model" and "no reward model is served ('tiny'" in error["message"], error
    assert error["code"] == "model_not_a_verifier", error
    named = httpx.post(server.url + path, json=body | {"model": "tiny"}, headers=headers, timeout=30)
    assert named.status_code == 400 and named.json()["error"]["code"] == error["code"], named.text


@pytest.mark.parametrize("strategy", ["beam", "best_of_n", "greedy"])
def test_a_search_verifier_that_is_no_reward_model_is_named_where_none_is_served(server, strategy):
    """A served model that is no reward model as a search's `verifier`, on a server of none, was "verifier:
    this field is required" (the field was given): it is the 400 `model_not_a_verifier` naming it and the
    reward models served (none), as on a server that has some."""
    body = {"model": "tiny", "verifier": "tiny", "question": QUESTION, "strategy": strategy, "n": 4}
    response = httpx.post(server.url + "/v1/search", json=body, headers={"Authorization": f"Bearer {server.key}"},
                          timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "verifier" and error["code"] == "model_not_a_verifier", error
    assert "'tiny' is not served as a verifier (served verifiers: none)" in error["message"], error
