"""vLLM's offline beam search (`LLM.beam_search`) on treeserve's engine.

The algorithm is vLLM's (vllm/entrypoints/llm.py, vllm/beam_search.py), step by step:
- every live beam offers its 2 * beam_width most likely next tokens (the model's log-softmax over the
  raw logits); a candidate ending in EOS joins the prompt's completed list (unless `ignore_eos`), the
  others compete for the beam_width live beams of the next step;
- beams are ranked by cum_logprob / len(tokens) ** length_penalty, where `tokens` are the prompt's and
  the generated ones and a final EOS does not count;
- the search always runs max_tokens steps (fewer only where the context ends); at the end the live
  beams join the completed ones and the best beam_width of them are returned, best first, each with
  `.tokens` (prompt included), `.text` (the decoded `.tokens`, the EOS's text included) and
  `.cum_logprob` (the generated tokens' logprobs summed).

Where HF transformers' `generate(num_beams=...)` differs (tests/test_beam_search.py checks both):
- HF ranks the 2 * num_beams best candidates over all beams together and takes a finished (EOS)
  hypothesis only from its first num_beams; vLLM takes every EOS candidate of every beam. The beams
  that stay live are the same: without EOS both return the same sequences and scores;
- HF's length penalty divides by the generated length (EOS included), vLLM's by the whole length
  (prompt included, EOS not): with EOS and a length_penalty other than 0 the ranking can differ;
- HF stops early (`early_stopping`) once num_beams hypotheses are done, or when none live can beat
  them; vLLM runs every step and keeps every EOS candidate, so it may return more finished ones.

Differences from vLLM, deliberate:
- scoring reuses the KV of each beam's parent (a kept sequence, forked: the prompt is computed once,
  then one token per beam per step); vLLM submits each beam's whole sequence again every step and
  relies on its prefix cache, which recomputes the last partial block;
- EOS is any of the model's stop ids (`generate` stops on the same), not only the tokenizer's;
- `temperature` does not change the scores: vLLM v1 reads its logprobs before temperature as well,
  but also offers the one token it sampled at that temperature as one more candidate (a random
  extra); treeserve's search is deterministic. `include_stop_str_in_output` is taken and, as in
  vLLM's offline `beam_search`, has no effect;
- a beam that reaches the model's context length stops there (finish_reason "length") instead of
  being dropped.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from treeserve.engine.engine_loop import EngineLoop
from treeserve.engine.llm_engine import LLMEngine
from treeserve.outputs import Logprob, RequestOutput
from treeserve.sampling_params import BeamSearchParams, SamplingParams

_REQUEST_IDS = itertools.count()  # unique in the process: several searches may share one engine
_ONE_STEP = SamplingParams(max_tokens=1)


@dataclass
class BeamSearchSequence:
    """One beam: vLLM's fields. `tokens` include the prompt; `logprobs` has one dict per generated
    token (the candidates offered at that step, with their ranks)."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # the kept engine sequence that computed tokens[:-1]: this beam's next step forks it
    parent_id: str | None = field(default=None, repr=False, compare=False)


@dataclass
class BeamSearchOutput:
    """The best beam_width sequences of one prompt, best first."""
    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_ids: Sequence[int], length_penalty: float) -> float:
    """vLLM's rank of a beam: its logprob over its length (prompt included, a final EOS not) ** penalty."""
    length = len(tokens) - (tokens[-1] in eos_ids)
    return cum_logprob / (max(length, 1) ** length_penalty)


class _Instance:
    """One prompt's search: its live beams, its completed ones, and how long its beams may grow."""

    def __init__(self, prompt_token_ids: list[int], max_length: int, cache_salt: str | None):
        self.beams = [BeamSearchSequence(list(prompt_token_ids), [])]
        self.cache_salt = cache_salt
        self.completed: list[BeamSearchSequence] = []
        self.max_length = max_length


class BeamSearch:
    """Runs vLLM's beam search for several prompts at once on one engine, through its loop."""

    def __init__(self, engine: LLMEngine, loop: EngineLoop, params: BeamSearchParams):
        self.engine, self.loop, self.params = engine, loop, params
        self.eos_ids = tuple(engine.loaded.eos_token_ids)  # (a final one never counts in a beam's length)
        self.stop_ids = () if params.ignore_eos else self.eos_ids  # (where a beam ends)
        self.kept: set[str] = set()  # engine sequences this search keeps (released as it goes)

    def run(self, prompts: list[tuple[list[int], str | None]], on_step=None) -> list[BeamSearchOutput]:
        """`prompts`: each one's token ids and cache salt; `on_step` is called after each step."""
        limit = self.engine.max_model_len
        instances = [_Instance(ids, min(len(ids) + self.params.max_tokens, limit), salt) for ids, salt in prompts]
        try:
            for _ in range(self.params.max_tokens):
                live = [i for i in instances if i.beams and len(i.beams[0].tokens) < i.max_length]
                if not live:
                    break
                self._step(live)
                if on_step is not None:
                    on_step()
        finally:
            for request_id in self.kept:
                self.engine.release_kv(request_id)
            self.kept.clear()
        return [self._output(instance) for instance in instances]

    def _step(self, instances: list[_Instance]) -> None:
        beams = [(beam, instance.cache_salt) for instance in instances for beam in instance.beams]
        outputs = self._next_token_logits(beams)
        for instance in instances:
            fresh: list[BeamSearchSequence] = []
            for beam in instance.beams:
                request_id, logits = outputs[id(beam)]
                for child in self._children(beam, logits, request_id):
                    (instance.completed if child.tokens[-1] in self.stop_ids else fresh).append(child)
            fresh.sort(key=self._score, reverse=True)
            instance.beams = fresh[: self.params.beam_width]
        wanted = {beam.parent_id for instance in instances for beam in instance.beams}
        for request_id in [r for r in self.kept if r not in wanted]:
            self.kept.discard(request_id)
            self.engine.release_kv(request_id)

    def _next_token_logits(self, beams: list[tuple[BeamSearchSequence, str | None]]
                           ) -> dict[int, tuple[str, torch.Tensor]]:
        """Each beam's next-token logits, as prefill-only requests that fork the beam's parent (only
        the last token is computed) and are kept for the beam's children."""
        done: dict[str, RequestOutput] = {}
        asked: dict[int, str] = {}

        def on_output(output: RequestOutput) -> None:
            if output.finished:
                done[output.request_id] = output
        try:
            for beam, salt in beams:
                request_id = f"beam-{next(_REQUEST_IDS)}"
                self.loop.add_request(self.engine, request_id, beam.tokens, _ONE_STEP, on_output, cache_salt=salt,
                                      logits_positions=[len(beam.tokens) - 1], keep_kv=True,
                                      parent_id=beam.parent_id, final_only=True)
                asked[id(beam)] = request_id
                self.kept.add(request_id)
            for parent in {beam.parent_id for beam, _ in beams} - {None}:  # (forked: the children hold its blocks)
                self.kept.discard(parent)
                self.engine.release_kv(parent)
            self.loop.run_until(lambda: len(done) == len(asked))
        except BaseException:
            for request_id in asked.values():
                self.loop.abort_request(self.engine, request_id)
            raise
        return {key: (rid, done[rid].prompt_logits[len(done[rid].prompt_token_ids) - 1]) for key, rid in asked.items()}

    def _children(self, beam: BeamSearchSequence, logits: torch.Tensor, request_id: str) -> list[BeamSearchSequence]:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logprobs, min(2 * self.params.beam_width, logprobs.numel()))
        offered = {token: Logprob(lp, rank) for rank, (lp, token)
                   in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1)}
        return [BeamSearchSequence(beam.tokens + [token], beam.logprobs + [offered], beam.cum_logprob + lp.logprob,
                                   parent_id=request_id) for token, lp in offered.items()]

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, self.eos_ids, self.params.length_penalty)

    def _output(self, instance: _Instance) -> BeamSearchOutput:
        best = sorted(instance.completed + instance.beams, key=self._score, reverse=True)[: self.params.beam_width]
        for beam in best:
            beam.parent_id = None
            beam.text = self.engine.tokenizer.decode(beam.tokens)
            beam.finish_reason = "stop" if beam.tokens[-1] in self.stop_ids else "length"
        return BeamSearchOutput(best)
