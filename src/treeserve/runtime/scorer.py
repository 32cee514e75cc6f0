"""Step scoring with a process reward model: batched prefill-only requests, a score cache, and
kept KV so that scoring steps 1..k+1 after 1..k computes only the new tokens.

The scorer is a state machine on the engine loop: `submit` queues what is not cached and returns a
`ScoreTicket`; the loop routes the verifier's outputs back, and the ticket is ready (its callback
runs) once every step it asked for has a score. `score_many` is the blocking form, for offline use.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Callable

from treeserve.errors import ParamError
from treeserve.engine.engine_loop import EngineLoop
from treeserve.engine.llm_engine import LLMEngine
from treeserve.engine.request import BACKGROUND_PRIORITY
from treeserve.runtime.kept_conversations import KeptConversations, StepKey
from treeserve.runtime.prm_recipes import (DEFAULT_RECIPE, RECIPES, PRMInput, build_many, check_recipe_fits,
                                           read_columns)
from treeserve.runtime.score_cache import ScoreCache
from treeserve.sampling_params import SamplingParams

MAX_KEPT_SEQUENCES = 512
# Kept sequences pin their blocks; past this share of the pool in use they are released instead
# (their full blocks stay in the prefix cache, so an extension recomputes at most one block).
KEEP_BELOW_USAGE = 0.5
# The score of a step the verifier cannot read: its conversation is longer than the verifier's
# maximum model length. Any aggregation then ranks the candidate last, and the search goes on.
UNJUDGED_SCORE = 0.0
# Verifier inputs remembered after they were built: a direct scoring request checks that its input
# fits (`require_readable`) and then submits it, and each would otherwise render and tokenize it.
BUILT_INPUTS = 256
# A submit's inputs are built (their texts tokenized in one call) this many at a time
BUILT_AT_ONCE = 64
# Request ids unique in the process: several scorers may share one engine.
_REQUEST_IDS = itertools.count()



@dataclass(eq=False)
class ScoreTicket:
    """What one `submit` asked for; ready once every step of every item has its score."""
    items: list[tuple[str, list[str]]]
    on_ready: Callable[["ScoreTicket"], None] | None = None
    scores: dict[StepKey, float] = field(default_factory=dict)
    missing: set[StepKey] = field(default_factory=set)
    cancelled: bool = False

    @property
    def ready(self) -> bool:
        return not self.missing

    def results(self) -> list[list[float]]:
        return [[self.scores[(q, *s)[: i + 2]] for i in range(len(s))] for q, s in self.items]


class StepScorer:
    def __init__(self, engine: LLMEngine, recipe: str = DEFAULT_RECIPE, max_kept: int = MAX_KEPT_SEQUENCES,
                 loop: EngineLoop | None = None,
                 score_cache_bytes: int | None = None):
        if recipe not in RECIPES:
            raise ParamError("recipe", f"unknown PRM recipe {recipe!r}; known: {', '.join(RECIPES)}")
        self.engine = engine
        self.loop = loop or EngineLoop.of(engine)
        self.recipe = RECIPES[recipe]
        try:
            check_recipe_fits(self.recipe, engine.model_config)
        except ValueError as exc:
            raise ParamError("recipe", str(exc)) from None
        self.candidates = read_columns(self.recipe, engine.tokenizer)  # None: whole logit rows
        self.score_cache = ScoreCache(score_cache_bytes) if score_cache_bytes else ScoreCache()
        self.kept = KeptConversations()  # (question, steps...) -> engine request id, released first at the front
        self.max_kept = max_kept
        self._wanted: dict[str, tuple[StepKey, list[int], list[int]]] = {}
        # step keys that a request in flight will score: another request sharing those steps does
        # not ask for them again, so its cached prefix can run past them (best-of-N's completions)
        self._claimed: set[StepKey] = set()
        self._waiting: dict[StepKey, list[ScoreTicket]] = defaultdict(list)
        self.num_cache_hits = 0  # items answered without a request of their own (cached, in flight, or unreadable)
        self.num_unjudged_steps = 0  # steps given UNJUDGED_SCORE: their conversation did not fit
        self.num_prompt_tokens = 0  # tokens of every verifier input submitted (computed or reused)
        self.num_reused_tokens = 0  # of those, tokens the engine found kept or prefix-cached
        self._built: OrderedDict[StepKey, PRMInput] = OrderedDict()  # most recently built last
        self._built_lock = threading.Lock()  # the server checks inputs on its event loop, scores on the engine's

    # ---- blocking use (offline) ------------------------------------------------------------
    def score_steps(self, question: str, steps: list[str]) -> list[float]:
        return self.score_many([(question, steps)])[0]

    def score_many(self, items: list[tuple[str, list[str]]]) -> list[list[float]]:
        """One score per step for each (question, steps); uncached ones are scored in one batch."""
        try:
            ticket = self.submit(items, release_unrelated=True)
            self.loop.run_until(lambda: ticket.ready)
        except BaseException:
            self.cancel_pending()
            raise
        return ticket.results()

    def require_readable(self, question: str, steps: list[str], field: str = "steps") -> None:
        """Raises ValueError when the conversation is too long for the verifier to read (where a
        caller wants an error rather than UNJUDGED_SCORE: a direct scoring request), naming `field`
        (what the caller sent: /pooling's `messages`), or when a step is empty (a search's never
        are: it drops empty pieces; the server's routes say the same)."""
        _require_steps(steps)
        empty = [i for i, step in enumerate(steps) if not step.strip()]
        if empty:
            raise ParamError(f"steps[{empty[0]}]", "a step is empty")
        length = len(self.build(question, steps).token_ids)
        if length >= self.engine.max_model_len:
            raise ParamError(field, f"the verifier input is {length} tokens; the verifier reads fewer than "
                             f"its maximum model length {self.engine.max_model_len}")

    def build(self, question: str, steps: list[str]) -> PRMInput:
        """The verifier input for these steps, rendered once for a check and the request after it."""
        return self.build_many([(question, steps)])[0]

    def build_many(self, items: list[tuple[str, list[str]]]) -> list[PRMInput]:
        """Each item's verifier input: remembered ones as they were, the others built together (their
        texts tokenized in one call) and remembered."""
        keys = [(question, *steps) for question, steps in items]
        with self._built_lock:
            built = {key: self._built.pop(key) for key in keys if key in self._built}
        missing = {key: (question, list(steps)) for key, (question, steps) in zip(keys, items) if key not in built}
        try:
            if missing:
                built.update(zip(missing, build_many(self.recipe, self.engine.tokenizer, list(missing.values()))))
        except BaseException:
            with self._built_lock:  # (what was remembered stays so)
                self._built.update(built)
            raise
        with self._built_lock:
            for key in keys:
                self._built[key] = built[key]
            while len(self._built) > BUILT_INPUTS:
                self._built.popitem(last=False)
        return [built[key] for key in keys]

    # ---- the state machine -----------------------------------------------------------------
    def submit(self, items: list[tuple[str, list[str]]], on_ready: Callable[[ScoreTicket], None] | None = None,
               release_unrelated: bool = False) -> ScoreTicket:
        """Queues the uncached items; the ticket is ready (and `on_ready` runs) once all are scored.

        Kept sequences that the new requests extend are released once forked (step-wise search
        extends each one once); with `release_unrelated`, every other kept sequence too."""
        for _, steps in items:
            _require_steps(steps)
        ticket = self._ticket(items, on_ready)
        try:
            pending = self._submit_uncached(items)
        except BaseException:
            self.cancel(ticket)
            raise
        if pending or not release_unrelated:
            extended = {key[:j] for key in pending for j in range(2, len(key))}
            for key in [k for k in self.kept if (k not in extended) == release_unrelated]:
                self.engine.release_kv(self.kept.pop(key))
        if ticket.ready and on_ready is not None:
            on_ready(ticket)
        return ticket

    def cancel(self, ticket: ScoreTicket) -> None:
        """Forgets a ticket; verifier requests that no other ticket waits on are aborted now."""
        ticket.cancelled = True
        for key in ticket.missing:
            waiters = self._waiting.get(key)
            if waiters is not None and ticket in waiters:
                waiters.remove(ticket)
                if not waiters:
                    del self._waiting[key]
        for request_id, (key, wanted, _) in list(self._wanted.items()):
            if not any(key[: i + 2] in self._waiting for i in wanted):
                self._abort(request_id)

    def cancel_pending(self) -> None:
        """Aborts every scoring request in flight and forgets every waiting ticket (a search that
        failed midway): otherwise its steps would stay claimed and its kept KV pinned."""
        for request_id in list(self._wanted):
            self._abort(request_id)
        self._waiting.clear()

    @property
    def has_pending(self) -> bool:
        return bool(self._wanted)

    def _ticket(self, items, on_ready) -> ScoreTicket:
        ticket = ScoreTicket(list(items), on_ready)
        for question, steps in items:
            key = (question, *steps)
            for i in range(len(steps)):
                step_key = key[: i + 2]
                score = self.score_cache.get(step_key)
                if score is not None:
                    ticket.scores[step_key] = score
                elif step_key not in ticket.missing:
                    ticket.missing.add(step_key)
                    self._waiting[step_key].append(ticket)
        return ticket

    def _abort(self, request_id: str) -> None:
        key, wanted, _ = self._wanted.pop(request_id)
        self.loop.abort_request(self.engine, request_id)
        self.engine.release_kv(request_id)
        self._claimed.difference_update(key[: i + 2] for i in wanted)

    def _set_score(self, step_key: StepKey, score: float) -> None:
        self.score_cache[step_key] = score
        self._claimed.discard(step_key)
        for ticket in self._waiting.pop(step_key, ()):
            ticket.scores[step_key] = score
            ticket.missing.discard(step_key)
            if ticket.ready and ticket.on_ready is not None:
                ticket.on_ready(ticket)

    def _submit_uncached(self, items: list[tuple[str, list[str]]]) -> dict[StepKey, str]:
        pending: dict[StepKey, str] = {}
        for start in range(0, len(items), BUILT_AT_ONCE):
            chunk = items[start:start + BUILT_AT_ONCE]
            self._build_unscored(chunk)
            for question, steps in chunk:
                key = (question, *steps)
                if key not in pending and self._unscored(key):
                    request_id = self._submit(question, list(steps))
                    if request_id is not None:
                        pending[key] = request_id
        self.num_cache_hits += len(items) - len(pending)
        return pending

    def _unscored(self, key: StepKey) -> bool:
        """Whether a step of the conversation has no score and nobody scoring it (a request in flight
        for the same steps claims only what it reads: a step whose score was evicted from the cache
        since then is asked for again)."""
        return not all(self._answered(key[: i + 2]) for i in range(len(key) - 1))

    def _build_unscored(self, items: list[tuple[str, list[str]]]) -> None:
        """The inputs `_submit` will ask for, built together; an item that cannot be built is left to
        `_submit`, which raises as it would have."""
        unscored = list({(q, *s): (q, s) for q, s in items if self._unscored((q, *s))}.values())
        if len(unscored) > 1:
            with contextlib.suppress(ValueError):
                self.build_many(unscored)

    def _answered(self, step_key: StepKey) -> bool:
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
                                             self.engine.max_model_len, build=self.build)
        for index in (i for i in wanted if i >= readable):
            self._set_score(key[: index + 2], UNJUDGED_SCORE)
            self.num_unjudged_steps += 1
        wanted = [i for i in wanted if i < readable]
        if not wanted:
            return None
        key = key[: readable + 1]
        # a kept conversation holding a wanted verdict cannot be forked: that position would not be
        # computed again (its score was evicted from the cache since)
        # (a likelihood recipe reads step k from the last token of step k-1 on: one step less)
        longest = min(len(key) - 1, wanted[0] + 1 - self.recipe.reads_step_tokens)
        parent_key = next((key[:j] for j in range(longest, 1, -1) if key[:j] in self.kept), None)
        parent_id = self.kept.get(parent_key) if parent_key else None
        request_id = f"score-{next(_REQUEST_IDS)}"
        self.num_prompt_tokens += len(prm_input.token_ids)
        self.loop.add_request(self.engine, request_id, prm_input.token_ids, SamplingParams(max_tokens=1),
                              self._on_output,
                              logits_positions=sorted({p for i in wanted for p in prm_input.positions_of(i)}),
                              readout_token_ids=self.candidates, keep_kv=True, parent_id=parent_id,
                              priority=BACKGROUND_PRIORITY)
        self._wanted[request_id] = (key, wanted, prm_input)
        self._claimed.update(key[: i + 2] for i in wanted)
        return request_id

    def _on_output(self, output) -> None:
        if output.finished and output.request_id in self._wanted:
            self._record(output)

    def _record(self, output) -> None:
        key, wanted, prm_input = self._wanted.pop(output.request_id)
        self.num_reused_tokens += output.num_cached_tokens
        if key in self.kept:  # two requests read the same conversation: keep the newer one
            self.engine.release_kv(self.kept.pop(key))
        self.kept.add(key, output.request_id)
        for index in wanted:
            self._set_score(key[: index + 2], self._score(output.prompt_logits, prm_input, index))
        # the engine releases kept KV in the same order when its pool runs short
        for request_id in self.kept.demote_below_best(key, self.score_cache.get):
            self.engine.release_kv_first(request_id)
        self._trim_kept()

    def _score(self, logits: dict, prm_input: PRMInput, index: int) -> float:
        """Step `index`'s score from the logits read at its positions."""
        if prm_input.reads is None:
            return self.recipe.score(logits[prm_input.verdict_positions[index]])
        return self.recipe.score_reads([(logits[position], ids) for position, ids in prm_input.reads[index]])

    def _trim_kept(self) -> None:
        while self.kept and (len(self.kept) > self.max_kept
                             or self.engine.stats().kv_pool_usage > KEEP_BELOW_USAGE):
            self.engine.release_kv(self.kept.pop(self.kept.first()))

    def release_all(self) -> None:
        while self.kept:
            self.engine.release_kv(self.kept.pop(self.kept.first()))


def readable_input(recipe, tokenizer, question: str, steps: list[str], max_model_len: int,
                   build: Callable[[str, list[str]], PRMInput] | None = None) -> tuple[int, PRMInput | None]:
    """The conversation cut to its leading steps that make fewer than `max_model_len` tokens:
    (how many steps, its verifier input); (0, None) when not even the first step fits. `build`
    replaces `recipe.build(tokenizer, ...)` (a scorer's remembered inputs)."""
    build = build or (lambda q, s: recipe.build(tokenizer, q, s))
    for count in range(len(steps), 0, -1):
        prm_input = build(question, steps[:count])
        if len(prm_input.token_ids) < max_model_len:
            return count, prm_input
    return 0, None


def given_question(question: str, where: str = "question") -> str:
    """The question, or ParamError(where) where it is empty or blank: the step scores of an answer to
    no question say nothing, and a search of one searches the model's noise at full cost. The CLI,
    the server's routes and direct scoring (`Runtime.score_many`) all ask this."""
    if not isinstance(question, str):
        raise ParamError(where, f"must be a string, got {type(question).__name__}")
    if not question.strip():
        raise ParamError(where, "the question is empty")
    return question


def given_questions(questions: Iterable[str], where: str = "questions") -> list[str]:
    """A batch's questions as a list, each checked (`given_question`, naming `questions[i]`) before any is
    searched. One string is a ParamError naming `questions`: its characters were searched one by one."""
    if isinstance(questions, (str, bytes)) or not isinstance(questions, Iterable):
        raise ParamError(where, f"must be a list of questions, got {type(questions).__name__}")
    return [given_question(question, f"{where}[{i}]") for i, question in enumerate(questions)]


def given_steps(steps: list[str], where: str = "steps") -> list[str]:
    """A caller's steps as the verifier reads them: stripped, as a search's are (its pieces are), so
    that the same steps score the same offline (`Runtime.score_steps`), over HTTP (the server's
    scoring routes) and in a search; an empty one is a ParamError naming it."""
    if isinstance(steps, str) or not isinstance(steps, (list, tuple)):
        # (a lone string would be read as one step a character)
        raise ParamError(where, f"must be a list of strings, got {type(steps).__name__}")
    if bad := [i for i, step in enumerate(steps) if not isinstance(step, str)]:
        raise ParamError(f"{where}[{bad[0]}]", f"must be a string, got {type(steps[bad[0]]).__name__}")
    stripped = [step.strip() for step in steps]
    if "" in stripped:
        raise ParamError(f"{where}[{stripped.index('')}]", "a step is empty")
    return stripped


def given_item(item, where: str) -> tuple[str, list[str]]:
    """One (question, steps) pair of direct scoring, each checked as above; anything else is a ParamError
    naming `where` (it was Python's own unpacking error, naming no item)."""
    if isinstance(item, str) or not isinstance(item, (list, tuple)) or len(item) != 2:
        got = f"a {type(item).__name__} of {len(item)}" if isinstance(item, (list, tuple)) else type(item).__name__
        raise ParamError(where, f"must be a (question, steps) pair, got {got}")
    question, steps = item
    return given_question(question, f"{where}.question"), given_steps(steps, f"{where}.steps")


def _require_steps(steps: list[str]) -> None:
    if not steps:
        raise ParamError("steps", "must contain at least one step")
