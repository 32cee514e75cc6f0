"""POST /v1/search: one question searched with a served generator and PRM, on the engine thread.

The search runs as a job between engine steps; while it runs it steps the engines itself and hands
the outputs of the server's other requests back to their streams, so they keep flowing. Requests
that arrive meanwhile wait until the search ends.
"""
from __future__ import annotations

from treeserve.engine.async_engine import AsyncLLMEngine
from treeserve.engine.llm_engine import LLMEngine
from treeserve.runtime.scorer import StepScorer
from treeserve.search.config import SAL_SYSTEM_PROMPT, SearchConfig
from treeserve.search.runner import SearchRunner
from treeserve.search.tree import SearchResult
from treeserve.server.errors import APIError, from_value_error
from treeserve.server.protocol import SearchRequest


def question_and_system(body: SearchRequest) -> tuple[str, str | None]:
    if (body.question is None) == (body.messages is None):
        raise APIError(400, "question: give exactly one of 'question' and 'messages'", param="question")
    system = body.system_prompt if body.system_prompt is not None else SAL_SYSTEM_PROMPT
    if body.question is not None:
        return body.question, system or None
    messages = [m.as_template_message() for m in body.messages]
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise APIError(400, "messages: needs a user message holding the question", param="messages")
    systems = [m["content"] for m in messages if m["role"] == "system"]
    return users[-1], (systems[-1] if systems else system) or None


def search_config(body: SearchRequest, system: str | None, aggregation: str = "last") -> SearchConfig:
    beam_width = body.beam_width if body.beam_width is not None else min(4, body.n)
    try:
        return SearchConfig(strategy=body.strategy, n=body.n, beam_width=beam_width,
                            num_iterations=body.num_iterations, lookahead=body.lookahead,
                            temperature=body.temperature, top_p=body.top_p, max_tokens=body.max_tokens,
                            agg_strategy=body.agg_strategy or aggregation, filter_duplicates=body.filter_duplicates,
                            sort_completed=body.sort_completed,
                            eos_sampling_at_max_depth=body.eos_sampling_at_max_depth, system_prompt=system,
                            seed=body.seed)
    except ValueError as exc:
        raise from_value_error(exc) from exc


async def run_search(engine: AsyncLLMEngine, generator: tuple[str, LLMEngine], scorers: dict[str, StepScorer],
                     body: SearchRequest) -> dict:
    question, system = question_and_system(body)
    scorer = scorers.get(body.verifier) if body.verifier is not None else None
    config = search_config(body, system, scorer.aggregation if scorer else "last")
    if not config.uses_verifier:
        scorer = None
    elif scorer is None:
        served = ", ".join(scorers) or "none"
        raise APIError(400, f"verifier: strategy '{config.strategy}' needs a served reward model "
                            f"(got {body.verifier!r}; served: {served})", param="verifier")
    name, llm = generator
    runner = SearchRunner(llm, scorer, on_other_output=engine.deliver_outputs_one)
    try:
        result = await engine.run_job(lambda: runner.run([question], config)[0])
    except ValueError as exc:
        raise from_value_error(exc) from exc
    return search_response(name, body.verifier if scorer else None, config, result)


def search_response(model: str, verifier: str | None, config: SearchConfig, result: SearchResult) -> dict:
    candidates = [{"index": i, "text": text, "answer": answer, "score": score, "step_scores": steps}
                  for i, (text, answer, score, steps) in enumerate(zip(result.completions, result.answers,
                                                                      result.agg_scores, result.scores))]
    return {"object": "search.result", "model": model, "verifier": verifier, "strategy": config.strategy,
            "n": config.n, "answer": result.pred, "completion": result.completions[result.chosen],
            "score": result.agg_scores[result.chosen], "chosen": result.chosen, "candidates": candidates,
            "tree_size": result.tree_size, "usage": {"completion_tokens": result.completion_tokens},
            "seconds": round(result.seconds, 4)}
