"""Turns the scheduler's decision (live `Request` objects, the KV manager's block tables) into plain
`StepData` for a model runner, sending each request whole once and then only what changed."""
from __future__ import annotations

from dataclasses import dataclass

from treeserve.engine import structured_outputs
from treeserve.engine.kv_cache_manager import KVCacheManager
from treeserve.engine.request import Request
from treeserve.engine.scheduler import SchedulerOutput
from treeserve.engine.step_data import IN_FLIGHT_TOKEN, CachedRequestData, NewRequestData, StepData


@dataclass
class _Sent:
    """What the runner holds of a request: its tokens and its block table (a preempted request
    keeps its place: the runner keeps its random generator; its table is resent as it changes)."""
    request: Request
    num_tokens: int
    block_ids: list[int]


class StepBuilder:
    def __init__(self, kv: KVCacheManager, vocab_size: int):
        self.kv, self.vocab_size = kv, vocab_size
        self._sent: dict[str, _Sent] = {}

    def request(self, req_id: str) -> Request:
        return self._sent[req_id].request

    def build(self, sched: SchedulerOutput) -> StepData:
        step = StepData(block_copies=sched.block_copies)
        step.finished_req_ids = self._forget_finished()
        for item in sched.scheduled:
            request = item.request
            step.scheduled.append((request.request_id, item.num_new_tokens))
            if item.num_draft_tokens:
                step.spec_token_ids[request.request_id] = list(request.spec_token_ids)
                if request.matcher is not None:
                    step.spec_grammar_bitmasks[request.request_id] = structured_outputs.draft_bitmasks(
                        request.matcher, request.spec_token_ids, self.vocab_size)
            self._describe(request, step)
        self._add_grammar_masks(sched, step)
        return step

    def _forget_finished(self) -> list[str]:
        gone = [rid for rid, sent in self._sent.items() if sent.request.is_finished]
        for rid in gone:
            del self._sent[rid]
        return gone

    def _describe(self, request: Request, step: StepData) -> None:
        rid = request.request_id
        blocks = self.kv.block_ids(request)
        sent = self._sent.get(rid)
        if sent is None or sent.request is not request:
            step.new_requests.append(NewRequestData(
                rid, request.all_token_ids + _in_flight(request), request.num_prompt_tokens, blocks, request.num_computed_tokens,
                request.sampling_params, request.eos_token_ids, request.prefill_only, request.logits_positions,
                request.readout_token_ids, request.prompt_logprob_ids))
            self._sent[rid] = _Sent(request, request.num_tokens, blocks)
            return
        keep = len(blocks) if blocks is sent.block_ids else _common_prefix(sent.block_ids, blocks)
        known = request.all_token_ids
        new_tokens = known[sent.num_tokens:]
        if request.num_in_flight:
            new_tokens += _in_flight(request)
        step.cached_requests.append(CachedRequestData(rid, new_tokens, keep, blocks[keep:], request.num_computed_tokens))
        sent.num_tokens, sent.block_ids = len(known) + request.num_in_flight, blocks  # (request.num_tokens)

    def _add_grammar_masks(self, sched: SchedulerOutput, step: StepData) -> None:
        """The grammar's allowed tokens for each constrained request that samples this step."""
        rows = [s.request for s in sched.scheduled if s.request.matcher is not None and s.completes_sequence
                and not s.request.prefill_only and not s.num_draft_tokens]
        if rows:
            step.grammar_req_ids = [r.request_id for r in rows]
            step.grammar_bitmask = structured_outputs.bitmask([r.matcher for r in rows], self.vocab_size)


def _in_flight(request: Request) -> list[int]:
    return [IN_FLIGHT_TOKEN] * request.num_in_flight


def _common_prefix(old: list[int], new: list[int]) -> int:
    """How many leading block ids the tables share (all of the old one, unless copy-on-write
    replaced its tail)."""
    count = min(len(old), len(new))
    if old[:count] == new[:count]:
        return count
    return next(i for i in range(count) if old[i] != new[i])
