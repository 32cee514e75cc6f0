"""vLLM's score body (`text_1`, `text_2`) on /v1/score and vLLM's /score, on the bundled pair: a
process reward model scores each solution (`text_2`) given its question (`text_1`), paired 1:1, 1:N
or N:N as vLLM pairs them, each solution's step scores equal to /pooling's for the same conversation.
Before, vLLM's body was a 400 "question: this field is required" (and /score a 404). treeserve's own
body (`question`, `steps`, `candidates`) keeps working on both paths; a body with fields of both, or
neither, is a 400 naming them."""
from __future__ import annotations

import httpx
import openai
import pytest

from conftest import wait_all_idle
from treeserve.tasks.arithmetic import parse_problem

# (the task's operands are 1-9: a question with `+ 17` is outside what the bundled PRM learnt, and it
# gives even the reference's first step ~3e-11)
QUESTION = "Start with 40 and work modulo 100. Step 1: - 5. Step 2: + 7. What is the result?"
OTHER = "Start with 10 and work modulo 100. Step 1: * 3. What is the result?"
RIGHT = parse_problem(QUESTION).solution  # (the reference's steps, in the format the bundled PRM learnt)
WRONG = RIGHT.replace("{42}", "{43}")
OTHER_SOLUTION = parse_problem(OTHER).solution


def _pooled(url: str, question: str, solution: str) -> list[float]:
    body = {"model": "prm", "messages": [{"role": "user", "content": question},
                                         {"role": "assistant", "content": solution}]}
    return httpx.post(f"{url}/pooling", json=body, timeout=60).json()["data"][0]["data"]


def test_vllm_body_scores_each_solution_given_its_question(bundled_pair_served):
    """1:N through the openai client (client.post, as for any custom route): one score per solution,
    its step scores (as /pooling's) aggregated as the PRM declares (the bundled one: `min`, by which
    /v1/search ranks its solutions)."""
    url, app = bundled_pair_served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    body = client.post("/score", cast_to=object, body={"model": "prm", "text_1": QUESTION, "text_2": [RIGHT, WRONG]})
    assert body["object"] == "list" and body["model"] == "prm" and body["id"].startswith("score-")
    assert isinstance(body["created"], int) and body["usage"]["prompt_tokens"] > 0
    assert [d["index"] for d in body["data"]] == [0, 1] and {d["object"] for d in body["data"]} == {"score"}
    for data, solution in zip(body["data"], (RIGHT, WRONG)):
        pooled = _pooled(url, QUESTION, solution)
        assert data["scores"] == pytest.approx(pooled, abs=1e-5)
        assert data["score"] == pytest.approx(min(pooled), abs=1e-5)
    right, wrong = (d["score"] for d in body["data"])
    assert right > 0.9 and wrong < 0.01, (right, wrong)  # (the wrong final answer is the improbable step)
    wait_all_idle(app)


def test_vllm_pairs_one_to_one_and_n_to_n_on_vllms_path(bundled_pair_served):
    """vLLM's /score path (plain httpx): strings are one pair; two lists pair index by index; a
    one-item text_1 goes with every text_2."""
    url, app = bundled_pair_served
    single = httpx.post(f"{url}/score", json={"model": "prm", "text_1": OTHER, "text_2": OTHER_SOLUTION}, timeout=60)
    assert single.status_code == 200, single.text
    assert [d["index"] for d in single.json()["data"]] == [0]
    assert single.json()["data"][0]["scores"] == pytest.approx(
        _pooled(url, OTHER, OTHER_SOLUTION), abs=1e-5)
    pairs = httpx.post(f"{url}/v1/score", json={"model": "prm", "text_1": [QUESTION, OTHER],
                                                "text_2": [RIGHT, OTHER_SOLUTION]}, timeout=60)
    assert pairs.status_code == 200, pairs.text
    assert pairs.json()["data"][1]["scores"] == pytest.approx(single.json()["data"][0]["scores"], abs=1e-5)
    assert pairs.json()["data"][0]["scores"] == pytest.approx(_pooled(url, QUESTION, RIGHT), abs=1e-5)
    broadcast = httpx.post(f"{url}/score", json={"model": "prm", "text_1": [QUESTION], "text_2": [RIGHT, WRONG],
                                                 "user": "u", "priority": 0, "use_activation": True}, timeout=60)
    assert broadcast.status_code == 200, broadcast.text
    assert len(broadcast.json()["data"]) == 2
    wait_all_idle(app)


def test_treeserve_body_still_scores_candidates_on_both_paths(bundled_pair_served):
    url, app = bundled_pair_served
    steps = RIGHT.split("\n\n")
    body = {"model": "prm", "question": QUESTION, "steps": steps[:-1], "candidates": [steps[-1]]}
    answers = [httpx.post(url + path, json=body, timeout=60) for path in ("/v1/score", "/score")]
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["prefix_scores"]) == len(steps) - 1
    assert answers[0].json()["data"] == answers[1].json()["data"]
    assert answers[0].json()["data"][0]["score"] == pytest.approx(_pooled(url, QUESTION, RIGHT)[-1], abs=1e-5)
    wait_all_idle(app)


@pytest.mark.parametrize("body, param", [
    ({"model": "prm", "text_1": "q", "text_2": "a", "question": "q"}, "text_1"),  # both bodies
    ({"model": "prm", "text_2": "a", "candidates": ["a"]}, "text_2"),
    ({"model": "prm"}, "text_1"),  # neither
    ({"model": "prm", "text_2": "a"}, "text_1"),
    ({"model": "prm", "text_1": "q"}, "text_2"),
    ({"model": "prm", "text_1": [], "text_2": "a"}, "text_1"),
    ({"model": "prm", "text_1": "q", "text_2": []}, "text_2"),
    ({"model": "prm", "text_1": ["q", "r"], "text_2": ["a", "b", "c"]}, "text_2"),  # neither 1:N nor N:N
    ({"model": "prm", "text_1": ["q", "r"], "text_2": "a"}, "text_2"),
    ({"model": "prm", "text_1": "q", "text_2": "\n\n"}, "text_2"),  # a solution with no steps
    ({"model": "prm", "text_1": "q", "text_2": ["a", " \n\n "]}, "text_2[1]"),
    ({"model": "prm", "text_1": "q", "text_2": [1]}, "text_2[0]"),  # (the item, not the field)
    ({"model": "prm", "text_1": "q", "text_2": ["a", ["b"]]}, "text_2[1]"),
    ({"model": "prm", "text_1": ["q", None], "text_2": ["a", "b"]}, "text_1[1]"),
    ({"model": "prm", "text_1": "q", "text_2": [{"text": "a"}]}, "text_2[0]"),
    ({"model": "prm", "text_1": None, "text_2": "a"}, "text_1"),
    ({"model": "prm", "text_1": 5, "text_2": "a"}, "text_1"),
    ({"model": "prm", "text_1": {"content": [{"type": "image_url"}]}, "text_2": "a"}, "text_1.content[0]"),
    ({"model": "prm", "text_1": "q", "text_2": "a", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ({"model": "prm", "text_1": "q", "text_2": "a", "use_activation": False}, "use_activation"),
    ({"model": "prm", "text_1": "q", "text_2": "a", "top_n": 1}, "top_n"),  # (/rerank's)
    ({"model": "prm", "text_1": QUESTION * 40, "text_2": ["Start: 40."]}, "text_2[0]"),  # too long to read
    ({"model": "gen", "text_1": QUESTION, "text_2": RIGHT}, "model"),  # not a verifier
])
def test_bad_vllm_score_bodies_are_400s_naming_the_field(bundled_pair_served, body, param):
    url, app = bundled_pair_served
    response = httpx.post(f"{url}/v1/score", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param.split("[")[0] in error["message"], error
    wait_all_idle(app)


def test_a_text_that_is_no_string_is_named_by_its_index(bundled_pair_served):
    url, _ = bundled_pair_served
    response = httpx.post(f"{url}/score", json={"model": "prm", "text_1": "q", "text_2": ["a", 7]}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "text_2[1]: each text must be a string, got a number"


def test_the_openai_client_sees_a_bad_request_naming_the_field(bundled_pair_served):
    url, _ = bundled_pair_served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/score", cast_to=object, body={"model": "prm", "text_1": ["q", "r"], "text_2": ["a", "b", "c"]})
    assert caught.value.body["param"] == "text_2" and "1:1, 1:N or N:N" in caught.value.body["message"]


WRONG_PARTS = (WRONG.partition("\n\n")[0] + "\n", WRONG.partition("\n\n")[2])  # (joined: WRONG)


def _text(*texts: str) -> dict:
    """vLLM's {"content": [parts]} of text parts."""
    return {"content": [{"type": "text", "text": text} for text in texts]}


@pytest.mark.parametrize("body", [
    {"queries": QUESTION, "documents": [RIGHT, WRONG]},
    {"queries": [QUESTION], "items": [RIGHT, WRONG]},
    {"data_1": QUESTION, "data_2": [RIGHT, WRONG]},
    {"text_1": _text(QUESTION), "text_2": [RIGHT, _text(WRONG)]},  # (an object of one text part: that text)
    {"queries": [_text(QUESTION)], "documents": [RIGHT, _text(*WRONG_PARTS)]},  # (an object in a list: its parts
    # joined by newlines)
    {"text_1": QUESTION, "text_2": [RIGHT, WRONG], "truncation_side": "left", "padding": "do_not_pad",
     "max_tokens_per_query": 0, "max_tokens_per_doc": 0},  # (vLLM's, asking for nothing)
])
def test_vllms_newer_score_bodies_score_as_text_1_and_text_2(bundled_pair_served, body):
    """vLLM's ScoreRequest takes questions and solutions as text_1/text_2, queries/documents,
    queries/items or data_1/data_2, each input a string or {"content": [parts]}: the same pairs,
    the same scores. Before, every one but text_1/text_2 of strings was a 400."""
    url, app = bundled_pair_served
    expected = httpx.post(f"{url}/score", json={"model": "prm", "text_1": QUESTION, "text_2": [RIGHT, WRONG]},
                          timeout=60).json()["data"]
    for path in ("/score", "/v1/score"):
        response = httpx.post(url + path, json={"model": "prm", **body}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["data"] == expected
    wait_all_idle(app)


IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}


@pytest.mark.parametrize("body, param", [
    ({"model": "prm", "queries": "q", "documents": "a", "text_1": "q"}, "text_1"),  # two of vLLM's bodies
    ({"model": "prm", "queries": "q", "documents": "a", "items": "a"}, "items"),
    ({"model": "prm", "data_1": "q", "text_2": "a"}, "data_1"),
    ({"model": "prm", "data_1": "q", "data_2": "a", "steps": []}, "data_1"),  # vLLM's and treeserve's
    ({"model": "prm", "queries": "q"}, "documents"),
    ({"model": "prm", "items": "a"}, "queries"),
    ({"model": "prm", "data_2": "a"}, "data_1"),
    ({"model": "prm", "queries": [], "items": "a"}, "queries"),
    ({"model": "prm", "data_1": {"content": []}, "data_2": "a"}, "data_1"),  # (no inputs)
    ({"model": "prm", "queries": "q", "documents": ["a", "b", "c"], "max_tokens_per_doc": 8}, "max_tokens_per_doc"),
    ({"model": "prm", "text_1": "q", "text_2": "a", "cache_salt": "salt"}, "cache_salt"),
    ({"model": "prm", "text_1": "q", "text_2": "a", "padding": "max_length"}, "padding"),
    # images (or any part but text): there is no multimodal PRM
    ({"model": "prm", "text_1": "q", "text_2": {"content": [IMAGE]}}, "text_2.content[0]"),
    ({"model": "prm", "queries": "q", "documents": [RIGHT, {"content": [{"type": "text", "text": "a"}, IMAGE]}]},
     "documents[1].content[1]"),
    ({"model": "prm", "data_1": [{"content": ["q"]}], "data_2": "a"}, "data_1[0].content[0]"),
    ({"model": "prm", "text_1": "q", "text_2": [{"content": [{"type": "text", "text": 5}]}]}, "text_2[0].content[0].text"),
    ({"model": "prm", "queries": "q", "documents": {"content": "a"}}, "documents"),
    # empty inputs: a question with no text, a solution with no steps
    ({"model": "prm", "text_1": "", "text_2": RIGHT}, "text_1"),
    ({"model": "prm", "text_1": [QUESTION, " \n"], "text_2": [RIGHT, RIGHT]}, "text_1[1]"),
    ({"model": "prm", "queries": _text(" ", "\n"), "documents": [RIGHT, RIGHT]}, "queries"),  # (its parts joined)
    ({"model": "prm", "queries": QUESTION, "documents": ""}, "documents"),
    ({"model": "prm", "data_1": QUESTION, "data_2": [RIGHT, _text()]}, "data_2[1]"),
    ({"model": "prm", "question": "", "candidates": [RIGHT]}, "question"),  # (treeserve's body)
])
def test_bad_newer_vllm_score_bodies_are_400s_naming_the_field(bundled_pair_served, body, param):
    url, app = bundled_pair_served
    response = httpx.post(f"{url}/score", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
    wait_all_idle(app)


QUESTION_PARTS = ("Start with 40 and work modulo 100.", "Step 1: - 5. Step 2: + 7. What is the result?")


@pytest.mark.parametrize("body, same_as", [
    ({"queries": _text(*QUESTION_PARTS), "documents": [RIGHT, WRONG]},
     {"text_1": "\n".join(QUESTION_PARTS), "text_2": [RIGHT, WRONG]}),
    ({"text_1": QUESTION, "text_2": _text(*WRONG_PARTS)}, {"text_1": QUESTION, "text_2": WRONG}),
])
def test_one_content_object_is_one_text_of_its_parts_joined(bundled_pair_served, body, same_as):
    """vLLM's ScoreInputs: a {"content": [parts]} not in a list is one input (vLLM's validate_score_input
    makes it a list of one), its text parts joined by newlines as in a list. Before, it was a text per
    part: a question of two parts went with two documents index by index (N:N), each half a question,
    and a solution of two parts was two solutions."""
    url, app = bundled_pair_served
    expected = httpx.post(f"{url}/score", json={"model": "prm", **same_as}, timeout=60).json()["data"]
    response = httpx.post(f"{url}/score", json={"model": "prm", **body}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["data"] == expected
    wait_all_idle(app)


def test_the_answer_is_vllms_score_response(bundled_pair_served):
    """The fields of vLLM's ScoreResponse (id "score-...", object, created, model, data of
    {index, object: "score", score}, usage), with treeserve's `scores` (the step scores) in each datum."""
    url, _ = bundled_pair_served
    body = httpx.post(f"{url}/score", json={"model": "prm", "queries": QUESTION, "documents": [RIGHT, WRONG]},
                      timeout=60).json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["id"].startswith("score-") and body["object"] == "list" and body["model"] == "prm"
    assert [set(d) for d in body["data"]] == [{"index", "object", "score", "scores"}] * 2
    assert all(isinstance(d["score"], float) for d in body["data"])
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] > 0 and usage["completion_tokens"] == 0


def test_a_vllm_body_without_model_scores_with_the_served_reward_model(bundled_pair_served):
    """vLLM's `model` may be left out (its served model): here the one reward model served. It was a
    400 "model: this field is required"."""
    url, app = bundled_pair_served
    unnamed = httpx.post(f"{url}/score", json={"queries": QUESTION, "documents": [RIGHT]}, timeout=60)
    assert unnamed.status_code == 200, unnamed.text
    named = httpx.post(f"{url}/score", json={"model": "prm", "queries": QUESTION, "documents": [RIGHT]}, timeout=60)
    assert unnamed.json()["model"] == "prm" and unnamed.json()["data"] == named.json()["data"]
    wait_all_idle(app)
