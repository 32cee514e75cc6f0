"""Search-and-Learn's original execution, kept to measure the speed-up against on the same models.

What it reproduces: problems go in fixed batches, each batch in lockstep until all its problems
finish, and the verifier scores a few conversations per forward pass, with S&L's batch sizes
(`sal_batch_sizes`); every step re-submits each beam's whole prompt as text (one request per
sample, the engine's prefix cache standing in for vLLM's); the verifier is Hugging Face
transformers re-encoding every whole conversation, with no KV reuse and no score cache; the last
step is sampled to end-of-sequence. The strategies themselves are the same code.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import AutoModelForCausalLM

from treeserve.engine.llm_engine import LLMEngine
from treeserve.entrypoints.llm import LLM
from treeserve.errors import ParamError
from treeserve.runtime.prm_recipes import DEFAULT_RECIPE, RECIPES, read_columns
from treeserve.runtime.scorer import UNJUDGED_SCORE, given_questions, readable_input
from treeserve.sampling_params import SamplingParams
from treeserve.search.config import STEP_DELIMITER, SearchConfig, with_aggregation
from treeserve.search.prompting import prompt_text
from treeserve.search.strategies import run_strategy
from treeserve.search.tree import Sample, Score, SearchResult, Step, step_from_completion


@dataclass(frozen=True)
class SalBatchSizes:
    search: int  # problems per lockstep batch (S&L's `search_batch_size`)
    prm: int     # conversations per verifier forward pass (S&L's `prm_batch_size`)


SAL_DEFAULT_BATCH_SIZES = SalBatchSizes(search=25, prm=4)  # S&L's `Config` defaults
# S&L's beam-search recipe for Llama-3.2-1B-Instruct, the study's generator; S&L's `Config` rejects
# any search batch but 1 for beam search, whose implementation is not batched.
SAL_BEAM_SEARCH_BATCH_SIZES = SalBatchSizes(search=1, prm=1)


def sal_batch_sizes(strategy: str) -> SalBatchSizes:
    return SAL_BEAM_SEARCH_BATCH_SIZES if strategy == "beam" else SAL_DEFAULT_BATCH_SIZES


class HFStepScorer:
    """Scores steps by running the whole conversation through HF transformers, every time."""

    def __init__(self, model_path: str, tokenizer, recipe: str = DEFAULT_RECIPE, dtype: torch.dtype = torch.float32,
                 max_len: int | None = None):
        self.recipe = RECIPES[recipe]
        if self.recipe.head != "lm":
            raise ParamError("recipe", f"the reference mode reads a language model's logits through "
                             f"AutoModelForCausalLM; recipe {recipe} reads a reward head it does not load")
        self.model_path = model_path
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        # as the engine: a conversation this long or longer is not read (UNJUDGED_SCORE)
        self.max_len = max_len or self.model.config.max_position_embeddings
        self.tokenizer = tokenizer
        self.candidates = read_columns(self.recipe, tokenizer)  # None: whole rows (lm-likelihood)
        self.num_tokens_computed = 0
        self.seconds = 0.0  # spent scoring, inputs built and forward passes run

    @torch.inference_mode()
    def score_many(self, items: list[tuple[str, list[str]]],
                   batch_size: int = SAL_DEFAULT_BATCH_SIZES.prm) -> list[list[float]]:
        start_time = time.perf_counter()
        inputs = [readable_input(self.recipe, self.tokenizer, q, steps, self.max_len)[1] for q, steps in items]
        rows = [i for i, x in enumerate(inputs) if x is not None]
        scores = [[UNJUDGED_SCORE] * len(steps) for _, steps in items]
        for start in range(0, len(rows), batch_size):
            batch = rows[start:start + batch_size]
            for row, row_scores in zip(batch, self._score_batch([inputs[i] for i in batch])):
                scores[row][: len(row_scores)] = row_scores
        self.seconds += time.perf_counter() - start_time
        return scores

    def _score_batch(self, batch) -> list[list[float]]:
        width = max(len(x.token_ids) for x in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, x in enumerate(batch):
            ids[row, : len(x.token_ids)] = torch.tensor(x.token_ids)
            mask[row, : len(x.token_ids)] = 1
        self.num_tokens_computed += int(mask.sum())
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        if self.candidates is None:
            return [[self.recipe.score_reads([(logits[row, p], tokens) for p, tokens in step]) for step in x.reads]
                    for row, x in enumerate(batch)]
        probs = torch.softmax(logits[..., self.candidates].float(), dim=-1)[..., 0]
        return [[float(probs[row, p]) for p in x.verdict_positions] for row, x in enumerate(batch)]


class ReferenceRunner:
    def __init__(self, generator: LLMEngine, scorer: HFStepScorer | None, batch_size: int | None = None,
                 prm_batch_size: int | None = None):
        self.generator = generator
        self.llm = LLM.from_engine(generator)
        self.scorer = scorer
        self.batch_size = batch_size          # None: S&L's for the strategy
        self.prm_batch_size = prm_batch_size  # None: S&L's for the strategy

    def run(self, questions: list[str], config: SearchConfig,
            on_result: Callable[[int, SearchResult], None] | None = None) -> list[SearchResult]:
        questions = given_questions(questions)  # as SearchRunner's
        verifier_dir = self.scorer.model_path if self.scorer is not None and config.uses_verifier else None
        config = with_aggregation(config.replace(eos_sampling_at_max_depth=True), verifier_dir)
        results: list[SearchResult] = []
        sal = sal_batch_sizes(config.strategy)
        size, prm_size = self.batch_size or sal.search, self.prm_batch_size or sal.prm
        for start in range(0, len(questions), size):
            batch = list(enumerate(questions[start:start + size], start))
            for index, result in self._run_batch(batch, config, prm_size):
                results.append(result)
                if on_result is not None:
                    on_result(index, result)
        return results

    def _run_batch(self, batch: list[tuple[int, str]], config: SearchConfig,
                   prm_batch_size: int) -> list[tuple[int, SearchResult]]:
        started = time.perf_counter()
        tokenizer = self.generator.tokenizer
        live = {i: (q, run_strategy(q, config, i), prompt_text(tokenizer, q, config)) for i, q in batch}
        actions = {i: live[i][1].send(None) for i in live}
        finished: dict[int, SearchResult] = {}
        while actions:
            replies = self._sample_all({i: a for i, a in actions.items() if isinstance(a, Sample)}, live, config)
            replies |= self._score_all({i: a for i, a in actions.items() if isinstance(a, Score)}, prm_batch_size)
            actions = {}
            for i, reply in replies.items():
                try:
                    actions[i] = live[i][1].send(reply)
                except StopIteration as stop:
                    finished[i] = stop.value
        for result in finished.values():
            result.seconds = time.perf_counter() - started
        return sorted(finished.items())

    def _sample_all(self, samples: dict[int, Sample], live, config: SearchConfig) -> dict[int, list]:
        prompts, params, owners = [], [], []
        tokenizer = self.generator.tokenizer
        replies = {i: [[] for _ in action.beams] for i, action in samples.items()}
        for i, action in samples.items():
            for b, (beam, count, seed) in enumerate(zip(action.beams, action.counts, action.seeds)):
                text = live[i][2] + beam.text
                if len(tokenizer.encode(text, add_special_tokens=False)) >= self.generator.max_model_len:
                    replies[i][b] = [Step("", [], "length")] * count
                    continue
                for j in range(count):
                    prompts.append(text)
                    params.append(SamplingParams(
                        temperature=0.0 if action.greedy else config.temperature,
                        top_p=1.0 if action.greedy else config.top_p, max_tokens=config.max_tokens, seed=seed + j,
                        stop=None if action.to_end else [STEP_DELIMITER], include_stop_str_in_output=True))
                    owners.append((i, b))
        outputs = self.llm.generate(prompts, params, use_tqdm=False) if prompts else []
        for (i, b), output in zip(owners, outputs):
            replies[i][b].append(step_from_completion(output.outputs[0]))
        return replies

    def _score_all(self, scores: dict[int, Score], batch_size: int) -> dict[int, list]:
        per_action = {i: a.items() for i, a in scores.items()}
        items = [item for batch in per_action.values() for item in batch]
        flat = iter(self.scorer.score_many(items, batch_size) if items else [])
        return {i: a.reply([next(flat) for _ in per_action[i]]) for i, a in scores.items()}

