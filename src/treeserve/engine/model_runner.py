"""Runs one scheduler step on the model: flat batch in, sampled tokens (and requested logits) out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from treeserve.engine.kv_arena import KVArena, kv_bytes_per_token
from treeserve.engine import prompt_logprobs
from treeserve.engine.cuda_graphs import DecodeGraphs
from treeserve.engine.kv_cache_manager import KVCacheManager
from treeserve.engine.request import Request
from treeserve.engine.sampler import PendingSamples, Sampler, SamplerOutput
from treeserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from treeserve.model.decoder import DecoderForCausalLM
from treeserve.model.transfer import to_device


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: Any  # the attention backend's metadata
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


@dataclass
class LaunchedStep:
    hidden: torch.Tensor
    inputs: StepInputs
    samples: PendingSamples | None


def kv_bytes_per_block(model: DecoderForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    return block_size * kv_bytes_per_token(model.config, dtype)


class ModelRunner:
    """`graphs`: decode-only steps replayed from CUDA graphs where a bucket fits (None: eager)."""

    def __init__(self, model: DecoderForCausalLM, kv: KVCacheManager, arena: KVArena, dtype: torch.dtype,
                 device: torch.device, graphs: DecodeGraphs | None = None):
        self.model, self.kv, self.arena, self.device = model, kv, arena, device
        self.block_size = kv.block_size
        self.kv_caches = arena.layer_views(model.config, dtype)
        self.sampler = Sampler()
        self.backend = model.backend
        self.graphs = graphs

    @property
    def decode_group_max_keys(self) -> int | None:
        """The torch backend's cap on one gathered decode group's keys (CPU)."""
        return getattr(self.backend, "decode_group_max_keys", None)

    @decode_group_max_keys.setter
    def decode_group_max_keys(self, value: int | None) -> None:
        self.backend.decode_group_max_keys = value

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.wait(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> "LaunchedStep":
        """Queues the step's work on the device (forward pass, sampling, the copy of sampled ids to
        the host) and returns without waiting for it (on CPU the work is done by then)."""
        self.arena.copy_pages(sched.block_copies)
        inputs = self.prepare_inputs(sched.scheduled)
        hidden = self._forward(inputs)
        return LaunchedStep(hidden, inputs, self._sample(hidden, inputs))

    @torch.inference_mode()
    def wait(self, step: "LaunchedStep") -> ModelRunnerOutput:
        """The launched step's results on the host."""
        hidden, inputs = step.hidden, step.inputs
        sampled = {}
        if step.samples is not None:
            result: SamplerOutput = step.samples.result()
            sampled = {r.request_id: (t, lp) for r, t, lp in zip(inputs.sample_requests, result.token_ids,
                                                                  result.logprobs)}
        readouts = self._readouts(hidden, inputs)
        prompt = prompt_logprobs.compute(self.model.compute_logits, hidden, inputs.prompt_logprob_rows,
                                         self.model.config.vocab_size) if inputs.prompt_logprob_rows else []
        return ModelRunnerOutput(sampled, readouts, prompt)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        num_rows = inputs.input_ids.shape[0]
        if self.graphs is not None and self.graphs.fits(num_rows, inputs.meta):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs) -> PendingSamples | None:
        if not inputs.sample_rows:
            return None
        rows = to_device(torch.tensor(inputs.sample_rows), self.device)
        return self.sampler.sample_async(self.model.compute_logits(hidden[rows]), inputs.sample_requests)

    def _readouts(self, hidden: torch.Tensor, inputs: StepInputs) -> list[tuple[Request, int, torch.Tensor]]:
        """Each readout row's logits (or the asked columns of them), copied to the host at once."""
        if not inputs.readout_rows:
            return []
        rows = to_device(torch.tensor([row for _, _, row in inputs.readout_rows]), self.device)
        logits = self.model.compute_logits(hidden[rows])
        picked = [logits[i] if request.readout_token_ids is None else logits[i, request.readout_token_ids]
                  for i, (request, _, _) in enumerate(inputs.readout_rows)]
        host = torch.cat(picked).cpu().split([row.shape[0] for row in picked])
        return [(request, position, row) for (request, position, _), row in zip(inputs.readout_rows, host)]

    def prepare_inputs(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        decodes = sorted((s for s in scheduled if s.num_new_tokens == 1), key=lambda s: s.request.num_computed_tokens)
        # prefills whose rows can join the paged rows first (stable: otherwise in scheduling order)
        prefills = sorted((s for s in scheduled if s.num_new_tokens > 1), key=lambda s: not self._paged_prefill(s))
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        builder = self.backend.metadata_builder(self.block_size, self.device)
        inputs = StepInputs(torch.empty(0), torch.empty(0), None, decodes + prefills)
        self._add_decodes(decodes, inputs, builder, token_ids, positions, slots)
        for s in prefills:
            self._add_prefill(s, inputs, builder, token_ids, positions, slots)
        inputs.input_ids = to_device(torch.tensor(token_ids, dtype=torch.long), self.device)
        inputs.positions = to_device(torch.cat(positions), self.device)
        inputs.meta = builder.build(to_device(torch.cat(slots), self.device))
        return inputs

    def _paged_prefill(self, s: ScheduledRequest) -> bool:
        return s.request.num_computed_tokens + s.num_new_tokens <= self.backend.paged_prefill_max_context

    def _add_decodes(self, decodes, inputs, builder, token_ids, positions, slots) -> None:
        bs = self.block_size
        pos_list, slot_list = [], []
        for s in decodes:
            request = s.request
            pos = request.num_computed_tokens
            table = self.kv.block_ids(request)[:pos // bs + 1]
            token_ids.append(request.all_token_ids[pos])
            pos_list.append(pos)
            slot_list.append(table[-1] * bs + pos % bs)
            builder.add_decode(pos + 1, table)
            self._note_outputs(s, inputs, row=len(token_ids) - 1, first_pos=pos)
        positions.append(torch.tensor(pos_list, dtype=torch.long))
        slots.append(torch.tensor(slot_list, dtype=torch.long))

    def _add_prefill(self, s: ScheduledRequest, inputs, builder, token_ids, positions, slots) -> None:
        request, bs = s.request, self.block_size
        first, count = request.num_computed_tokens, s.num_new_tokens
        start_row = len(token_ids)
        token_ids.extend(request.all_token_ids[first:first + count])
        pos = torch.arange(first, first + count, dtype=torch.long)
        context_len = first + count
        table = self.kv.block_ids(request)[:-(-context_len // bs)]
        positions.append(pos)
        slots.append(torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs)
        builder.add_prefill(start_row, context_len, count, table)
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

