"""Step scoring with a process reward model: batched prefill-only requests, a score cache, and
kept KV so that scoring steps 1..k+1 after 1..k computes only the new tokens."""
from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from treeserve.engine.llm_engine import LLMEngine
from treeserve.runtime.prm_recipes import DEFAULT_AGGREGATION, DEFAULT_RECIPE, RECIPES, PRMInput
from treeserve.sampling_params import SamplingParams

MAX_KEPT_SEQUENCES = 512
# Kept sequences pin their blocks; past this share of the pool in use they are released instead
# (their full blocks stay in the prefix cache, so an extension recomputes at most one block).
KEEP_BELOW_USAGE = 0.5
# The score of a step the verifier cannot read: its conversation is longer than the verifier's
# maximum model length. Any aggregation then ranks the candidate last, and the search goes on.
UNJUDGED_SCORE = 0.0
# Request ids unique in the process: several scorers may share one engine.
_REQUEST_IDS = itertools.count()


class StepScorer:
    def __init__(self, engine: LLMEngine, recipe: str = DEFAULT_RECIPE, max_kept: int = MAX_KEPT_SEQUENCES,
                 aggregation: str = DEFAULT_AGGREGATION):
        if recipe not in RECIPES:
            raise ValueError(f"recipe: unknown PRM recipe {recipe!r}; known: {', '.join(RECIPES)}")
        self.engine = engine
        self.recipe = RECIPES[recipe]
        self.candidates = list(self.recipe.candidate_ids(engine.tokenizer))
        self.aggregation = aggregation  # search's agg_strategy where a request names none
        self.score_cache: dict[tuple, float] = {}       # (question, steps...) -> score of the last step
        self.kept: OrderedDict[tuple, str] = OrderedDict()  # (question, steps...) -> engine request id
        self.max_kept = max_kept
        self._wanted: dict[str, tuple[tuple, list[int], list[int]]] = {}
        # step keys that a request in flight will score: another request sharing those steps does
        # not ask for them again, so its cached prefix can run past them (best-of-N's completions)
        self._claimed: set[tuple] = set()
        self.num_cache_hits = 0  # items answered without a request of their own (cached, in flight, or unreadable)
        self.num_unjudged_steps = 0  # steps given UNJUDGED_SCORE: their conversation did not fit
        self.num_prompt_tokens = 0  # tokens of every verifier input submitted (computed or reused)
        # Outputs of other requests on the same engine, met while scoring drives it (the server
        # routes them to their streams); offline, nothing else runs on a scoring engine.
        self.on_other_output = None

    def score_steps(self, question: str, steps: list[str]) -> list[float]:
        return self.score_many([(question, steps)])[0]

    def require_readable(self, question: str, steps: list[str]) -> None:
        """Raises ValueError when the conversation is too long for the verifier to read (where a
        caller wants an error rather than UNJUDGED_SCORE: a direct scoring request)."""
        _require_steps(steps)
        length = len(self.recipe.build(self.engine.tokenizer, question, steps).token_ids)
        if length >= self.engine.max_model_len:
            raise ValueError(f"steps: the verifier input is {length} tokens; the verifier reads fewer than "
                             f"its maximum model length {self.engine.max_model_len}")

    def score_many(self, items: list[tuple[str, list[str]]]) -> list[list[float]]:
        """One score per step for each (question, steps); uncached ones are scored in one batch."""
        try:
            pending = self._submit_uncached(items)
            if pending:
                self._release_older_than(pending)
            self._run(items)
        except BaseException:
            self.cancel_pending()
            raise
        return self.results(items)

    def cancel_pending(self) -> None:
        """Aborts every scoring request in flight and forgets it (a search that failed midway):
        otherwise its steps would stay claimed and its kept KV pinned."""
        for request_id in self._wanted:
            self.engine.abort_request(request_id)
            self.engine.release_kv(request_id)
        self._wanted.clear()
        self._claimed.clear()

    def submit(self, items: list[tuple[str, list[str]]]) -> None:
        """Queues the uncached items without running the engine: whoever steps the engine passes
        its outputs to `collect`, and `results` is ready once `is_ready`. Kept sequences that the
        new requests extend are released once forked (step-wise search extends each one once)."""
        pending = self._submit_uncached(items)
        parents = {key[:j] for key in pending for j in range(2, len(key))}
        for key in [k for k in self.kept if k in parents]:
            self.engine.release_kv(self.kept.pop(key))

    def is_ready(self, items: list[tuple[str, list[str]]]) -> bool:
        return all((q, *s)[: i + 2] in self.score_cache for q, s in items for i in range(len(s)))

    def results(self, items: list[tuple[str, list[str]]]) -> list[list[float]]:
        return [[self.score_cache[(q, *s)[: i + 2]] for i in range(len(s))] for q, s in items]

    def collect(self, output) -> bool:
        """Records a finished scoring output; False when the output is not a scoring request."""
        if output.request_id not in self._wanted:
            return False
        if output.finished:
            self._record(output)
        return True

    @property
    def has_pending(self) -> bool:
        return bool(self._wanted)

    def _submit_uncached(self, items: list[tuple[str, list[str]]]) -> dict[tuple, str]:
        pending: dict[tuple, str] = {}
        in_flight = {key for key, _, _ in self._wanted.values()}
        for question, steps in items:
            _require_steps(steps)
            key = (question, *steps)
            if key in pending or key in in_flight:
                continue
            if not all(self._answered(key[: i + 2]) for i in range(len(steps))):
                request_id = self._submit(question, list(steps))
                if request_id is not None:
                    pending[key] = request_id
        self.num_cache_hits += len(items) - len(pending)
        return pending

    def _answered(self, step_key: tuple) -> bool:
        return step_key in self.score_cache or step_key in self._claimed

    def _submit(self, question: str, steps: list[str]) -> str | None:
        """Queues one verifier request for the steps nobody has scored or is scoring; None when
        there are none left, or when the conversation is too long to read (its unscored steps
        get UNJUDGED_SCORE at once)."""
        key = (question, *steps)
        wanted = [i for i in range(len(steps)) if not self._answered(key[: i + 2])]
        if not wanted:
            return None
        readable, prm_input = readable_input(self.recipe, self.engine.tokenizer, question, steps,
                                             self.engine.max_model_len)
        for index in (i for i in wanted if i >= readable):
            self.score_cache[key[: index + 2]] = UNJUDGED_SCORE
            self.num_unjudged_steps += 1
        wanted = [i for i in wanted if i < readable]
        if not wanted:
            return None
        key = key[: readable + 1]
        parent_key = next((key[:j] for j in range(len(key) - 1, 1, -1) if key[:j] in self.kept), None)
        parent_id = self.kept.get(parent_key) if parent_key else None
        request_id = f"score-{next(_REQUEST_IDS)}"
        self.num_prompt_tokens += len(prm_input.token_ids)
        self.engine.add_request(request_id, prm_input.token_ids, SamplingParams(max_tokens=1),
                                logits_positions=[prm_input.verdict_positions[i] for i in wanted],
                                readout_token_ids=self.candidates, keep_kv=True, parent_id=parent_id)
        self._wanted[request_id] = (key, wanted, prm_input.verdict_positions)
        self._claimed.update(key[: i + 2] for i in wanted)
        return request_id

    def _run(self, items: list[tuple[str, list[str]]]) -> None:
        while not self.is_ready(items):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("scoring requests vanished from the engine")
            for output in self.engine.step():
                if not self.collect(output) and self.on_other_output is not None:
                    self.on_other_output(output)

    def _record(self, output) -> None:
        key, wanted, positions = self._wanted.pop(output.request_id)
        for index in wanted:
            pair = output.prompt_logits[positions[index]]
            self.score_cache[key[: index + 2]] = float(torch.softmax(pair.float(), dim=-1)[0])
            self._claimed.discard(key[: index + 2])
        self.kept[key] = output.request_id
        pool = self.engine.kv.pool
        while self.kept and (len(self.kept) > self.max_kept or pool.usage() > KEEP_BELOW_USAGE):
            _, old_id = self.kept.popitem(last=False)
            self.engine.release_kv(old_id)

    def _release_older_than(self, pending: dict[tuple, str]) -> None:
        """Keeps KV only for the sequences this batch extends from or creates: step-wise search
        extends the latest steps, so older kept sequences would only crowd out other caches.
        New requests already hold their own references to the blocks they forked."""
        extended = {key[:j] for key in pending for j in range(2, len(key))}
        for key in [k for k in self.kept if k not in extended]:
            self.engine.release_kv(self.kept.pop(key))

    def release_all(self) -> None:
        while self.kept:
            _, request_id = self.kept.popitem(last=False)
            self.engine.release_kv(request_id)


def readable_input(recipe, tokenizer, question: str, steps: list[str],
                   max_model_len: int) -> tuple[int, PRMInput | None]:
    """The conversation cut to its leading steps that make fewer than `max_model_len` tokens:
    (how many steps, its verifier input); (0, None) when not even the first step fits."""
    for count in range(len(steps), 0, -1):
        prm_input = recipe.build(tokenizer, question, steps[:count])
        if len(prm_input.token_ids) < max_model_len:
            return count, prm_input
    return 0, None


def _require_steps(steps: list[str]) -> None:
    if not steps:
        raise ValueError("steps: must contain at least one step")
