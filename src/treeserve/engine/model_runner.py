"""Runs one scheduler step on the model: flat batch in, sampled tokens (and requested logits) out."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treeserve.model.attention import AttentionMetadata, PagedRows, PrefillChunk, paged_prefill_max_context
from treeserve.engine.kv_arena import KVArena, kv_bytes_per_token
from treeserve.engine import prompt_logprobs
from treeserve.engine.kv_cache_manager import KVCacheManager
from treeserve.engine.request import Request
from treeserve.engine.sampler import Sampler, SamplerOutput
from treeserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from treeserve.model.decoder import DecoderForCausalLM

# Where decode attention gathers (no C kernel), on CPU a group's gathered keys are also capped: a
# large gather is a fresh allocation whose pages the kernel must fault in on every layer. Capped at
# a few thousand keys, one decode step's attention ran 1.75-5.8x faster at 144 sequences of ~160 tokens and 4.2-5.7x at 480, across runs
# on a shared 2-core machine (benchmarks/decode_attention.py). CUDA's caching allocator has no
# such cost.
CPU_DECODE_GROUP_MAX_KEYS = 4096


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[ScheduledRequest]            # requests in flat-batch order
    sample_rows: list[int] = field(default_factory=list)
    sample_requests: list[Request] = field(default_factory=list)
    readout_rows: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, position, row)
    prompt_logprob_rows: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, position, row)


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, tuple[int, dict | None]]  # request_id -> (token id, logprobs)
    readouts: list[tuple[Request, int, torch.Tensor]]  # (request, position, logits)
    prompt_logprobs: list[tuple[Request, int, dict]] = field(default_factory=list)  # (request, token position, entry)


def kv_bytes_per_block(model: DecoderForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    return block_size * kv_bytes_per_token(model.config, dtype)


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv: KVCacheManager, arena: KVArena, dtype: torch.dtype,
                 device: torch.device):
        self.model, self.kv, self.arena, self.device = model, kv, arena, device
        self.block_size = kv.block_size
        self.kv_caches = arena.layer_views(model.config, dtype)
        self.sampler = Sampler()
        self.decode_group_max_keys = CPU_DECODE_GROUP_MAX_KEYS if device.type == "cpu" else None
        config = model.config
        self.paged_prefill_max_context = paged_prefill_max_context(dtype, config.num_heads, config.num_kv_heads)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.arena.copy_pages(sched.block_copies)
        inputs = self.prepare_inputs(sched.scheduled)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        sampled = self._sample(hidden, inputs)
        readouts = self._readouts(hidden, inputs)
        prompt = prompt_logprobs.compute(self.model.compute_logits, hidden, inputs.prompt_logprob_rows,
                                         self.model.config.vocab_size) if inputs.prompt_logprob_rows else []
        return ModelRunnerOutput(sampled, readouts, prompt)

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs) -> dict[str, tuple[int, dict | None]]:
        if not inputs.sample_rows:
            return {}
        rows = torch.tensor(inputs.sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        result: SamplerOutput = self.sampler(logits, inputs.sample_requests)
        return {r.request_id: (t, lp) for r, t, lp in zip(inputs.sample_requests, result.token_ids, result.logprobs)}

    def _readouts(self, hidden: torch.Tensor, inputs: StepInputs) -> list[tuple[Request, int, torch.Tensor]]:
        if not inputs.readout_rows:
            return []
        rows = torch.tensor([row for _, _, row in inputs.readout_rows], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        out = []
        for i, (request, position, _) in enumerate(inputs.readout_rows):
            row = logits[i] if request.readout_token_ids is None else logits[i, request.readout_token_ids]
            out.append((request, position, row.cpu()))
        return out

    def prepare_inputs(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        decodes = sorted((s for s in scheduled if s.num_new_tokens == 1), key=lambda s: s.request.num_computed_tokens)
        # prefills whose rows can join the paged rows first (stable: otherwise in scheduling order)
        prefills = sorted((s for s in scheduled if s.num_new_tokens > 1), key=lambda s: not self._paged_prefill(s))
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        paged = PagedRows(device=self.device, group_max_keys=self.decode_group_max_keys)
        meta = AttentionMetadata(slot_mapping=torch.empty(0), block_size=self.block_size, paged=paged)
        inputs = StepInputs(torch.empty(0), torch.empty(0), meta, decodes + prefills)
        self._add_decodes(decodes, inputs, token_ids, positions, slots)
        for s in prefills:
            self._add_prefill(s, inputs, token_ids, positions, slots)
        inputs.input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        inputs.positions = torch.cat(positions).to(self.device)
        meta.slot_mapping = torch.cat(slots).to(self.device)
        return inputs

    def _paged_prefill(self, s: ScheduledRequest) -> bool:
        return s.request.num_computed_tokens + s.num_new_tokens <= self.paged_prefill_max_context

    def _add_decodes(self, decodes, inputs, token_ids, positions, slots) -> None:
        bs = self.block_size
        pos_list, slot_list = [], []
        for s in decodes:
            request = s.request
            pos = request.num_computed_tokens
            table = self.kv.block_ids(request)[:pos // bs + 1]
            token_ids.append(request.all_token_ids[pos])
            pos_list.append(pos)
            slot_list.append(table[-1] * bs + pos % bs)
            inputs.meta.paged.add_decode(pos + 1, table)
            self._note_outputs(s, inputs, row=len(token_ids) - 1, first_pos=pos)
        positions.append(torch.tensor(pos_list, dtype=torch.long))
        slots.append(torch.tensor(slot_list, dtype=torch.long))

    def _add_prefill(self, s: ScheduledRequest, inputs, token_ids, positions, slots) -> None:
        request, bs = s.request, self.block_size
        first, count = request.num_computed_tokens, s.num_new_tokens
        start_row = len(token_ids)
        token_ids.extend(request.all_token_ids[first:first + count])
        pos = torch.arange(first, first + count, dtype=torch.long)
        context_len = first + count
        num_blocks = -(-context_len // bs)
        table = self.kv.block_ids(request)[:num_blocks]
        block_ids = torch.tensor(table, dtype=torch.long)
        positions.append(pos)
        slots.append(block_ids[pos // bs] * bs + pos % bs)
        inputs.meta.prefills.append(PrefillChunk(slice(start_row, start_row + count), context_len, count,
                                                 block_ids.to(self.device)))
        paged = inputs.meta.paged
        if self._paged_prefill(s) and paged.num_rows == start_row:  # the paged rows stay a prefix of the batch
            paged.add_prefill(context_len, count, table)
        self._note_outputs(s, inputs, row=start_row + count - 1, first_pos=first)

    @staticmethod
    def _note_outputs(s: ScheduledRequest, inputs: StepInputs, row: int, first_pos: int) -> None:
        """`row` is the flat-batch row of the chunk's last token, at position first_pos + count - 1."""
        request = s.request
        if request.prompt_logprob_ids is not None:
            first_row = row - s.num_new_tokens + 1
            inputs.prompt_logprob_rows.extend(prompt_logprobs.rows_for(request, first_pos, s.num_new_tokens, first_row))
        if request.prefill_only:
            last_pos = first_pos + s.num_new_tokens - 1
            for pos in request.logits_positions or ():
                if first_pos <= pos <= last_pos:
                    inputs.readout_rows.append((request, pos, row - (last_pos - pos)))
        elif s.completes_sequence:
            inputs.sample_rows.append(row)
            inputs.sample_requests.append(request)

