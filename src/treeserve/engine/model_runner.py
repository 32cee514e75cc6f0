"""Runs one step, given as plain `StepData`, on the model: flat batch in, sampled tokens (and
requested logits) out, keyed by request id. The runner keeps its own view of the requests
(`InputBatch`); it never sees the scheduler's requests or the KV manager."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from treeserve.engine import prompt_logprobs
from treeserve.engine.cuda_graphs import DecodeGraphs
from treeserve.engine.input_batch import CachedRequestState, InputBatch
from treeserve.engine.kv_arena import KVArena, kv_bytes_per_token
from treeserve.engine.sampler import PendingSamples, Sampler
from treeserve.engine.spec_decode import rejection
from treeserve.engine.step_data import IN_FLIGHT_TOKEN, ModelRunnerOutput, StepData
from treeserve.model.decoder import DecoderForCausalLM
from treeserve.model.transfer import StepStaging, to_device


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: Any  # the attention backend's metadata
    order: list[tuple[CachedRequestState, int]]  # (request, tokens this step) in flat-batch order
    sample_rows: list[int] = field(default_factory=list)
    sample_requests: list[CachedRequestState] = field(default_factory=list)
    readout_rows: list[tuple[CachedRequestState, int, int]] = field(default_factory=list)  # (request, position, row)
    prompt_logprob_rows: list[tuple[CachedRequestState, int, int]] = field(default_factory=list)
    grammar_rows: list[int] = field(default_factory=list)  # rows of the sample batch that a grammar masks
    grammar_bitmask: torch.Tensor | None = None
    in_flight_rows: list[tuple[int, str]] = field(default_factory=list)  # (row, request id): input token in flight
    # speculation: (request, the rows of its last known token and drafts, in order, its drafts)
    spec_rows: list[tuple[CachedRequestState, list[int], list[int]]] = field(default_factory=list)
    spec_grammar_bitmasks: dict[str, torch.Tensor] = field(default_factory=dict)  # by request id
    sample_rows_device: torch.Tensor | None = None  # `sample_rows` on the device
    in_flight_pairs: torch.Tensor | None = None  # [2, k] on the device: (row, last step's sample row) per in-flight row
    row_keys: list[tuple[str, int]] | None = None  # with `capture`: each row's (request id, position)


@dataclass
class LaunchedStep:
    hidden: torch.Tensor
    inputs: StepInputs
    samples: PendingSamples | None
    sample_positions: list[int] = field(default_factory=list)  # where each sampled token goes in its request
    accepted: dict = field(default_factory=dict)  # speculation: what each request's drafts gave (rejection.verify)
    captured: tuple | None = None  # with `capture`: (rows, their keys)


def kv_bytes_per_block(model: DecoderForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    return block_size * kv_bytes_per_token(model.kv_config, dtype)


class ModelRunner:
    """`graphs`: decode-only steps replayed from CUDA graphs where a bucket fits (None: eager)."""

    def __init__(self, model: DecoderForCausalLM, block_size: int, arena: KVArena, dtype: torch.dtype,
                 device: torch.device, graphs: DecodeGraphs | None = None):
        self.model, self.block_size, self.arena, self.device = model, block_size, arena, device
        self.kv_caches = arena.layer_views(model.kv_config, dtype)
        self.sampler = Sampler()
        self.backend = model.backend
        self.graphs = graphs
        self.batch = InputBatch()
        self.staging = StepStaging(device)  # a step's index tensors onto the device in one copy per dtype
        # EAGLE's features, kept per row: "final" (the final hidden states) or "aux" (the model's
        # `aux_hidden`); None: nothing kept
        self.capture: str | None = None
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None  # last step's ids on the device, rows

    def release(self) -> None:
        """Lets go of the model, its KV views, CUDA graphs (their memory pool) and the batch's
        device tensors: a closed engine's runner runs nothing again."""
        self.model = self.backend = self.graphs = self._last_sampled = None
        self.kv_caches, self.batch, self.staging = [], InputBatch(), StepStaging(self.device)

    @property
    def decode_group_max_keys(self) -> int | None:
        """The torch backend's cap on one gathered decode group's keys (CPU)."""
        return getattr(self.backend, "decode_group_max_keys", None)

    @decode_group_max_keys.setter
    def decode_group_max_keys(self, value: int | None) -> None:
        self.backend.decode_group_max_keys = value

    @torch.inference_mode()
    def execute(self, step: StepData) -> ModelRunnerOutput:
        return self.wait(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: StepData) -> LaunchedStep:
        """Takes the step's changes into the batch, then queues its work on the device (forward pass,
        sampling, the copy of sampled ids to the host) and returns without waiting for it (on CPU the
        work is done by then)."""
        self.batch.update(step)
        self.arena.copy_pages(step.block_copies)
        inputs = self.prepare_inputs(step)
        self._take_in_flight(inputs)
        hidden = self._forward(inputs)
        samples = self._sample(hidden, inputs)
        self._last_sampled = None if samples is None else (
            samples.token_ids, {state.request_id: i for i, state in enumerate(inputs.sample_requests)})
        launched = LaunchedStep(hidden, inputs, samples, [state.num_tokens for state in inputs.sample_requests],
                                self._verify(hidden, inputs))
        if self.capture is not None:
            launched.captured = (hidden if self.capture == "final" else self.model.aux_hidden, inputs.row_keys)
        return launched

    def _take_in_flight(self, inputs: StepInputs) -> None:
        """Input tokens that the previous step is still sampling (async scheduling): copied from its
        sampled ids on the device, behind it on the stream."""
        if not inputs.in_flight_rows:
            return
        pairs = inputs.in_flight_pairs
        inputs.input_ids[pairs[0]] = self._last_sampled[0][pairs[1]]

    @torch.inference_mode()
    def wait(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """The launched step's results on the host, keyed by request id."""
        hidden, inputs = launched.hidden, launched.inputs
        out = ModelRunnerOutput()
        if launched.samples is not None:
            result = launched.samples.result()
            out.sampled = {r.request_id: (t, lp) for r, t, lp in zip(inputs.sample_requests, result.token_ids,
                                                                      result.logprobs)}
            _fill_in_flight(inputs.sample_requests, launched.sample_positions, result.token_ids)
        out.accepted, out.hidden_rows = launched.accepted, launched.captured
        out.readouts = self._readouts(hidden, inputs)
        if inputs.prompt_logprob_rows:
            entries = prompt_logprobs.compute(self.model.compute_logits, hidden, inputs.prompt_logprob_rows,
                                              self.model.config.vocab_size)
            out.prompt_logprobs = [(r.request_id, position, entry) for r, position, entry in entries]
        return out

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        num_rows = inputs.input_ids.shape[0]
        if self.graphs is not None and self.graphs.fits(num_rows, inputs.meta):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs) -> PendingSamples | None:
        if not inputs.sample_rows:
            return None
        return self.sampler.sample_async(self.model.compute_logits(hidden[inputs.sample_rows_device]),
                                         inputs.sample_requests,
                                         inputs.grammar_rows, inputs.grammar_bitmask, self.batch.num_masked > 0)

    def _verify(self, hidden: torch.Tensor, inputs: StepInputs) -> dict:
        """The drafts of the step's speculating requests checked against the model (on the host: a
        step with drafts is never left running)."""
        if not inputs.spec_rows:
            return {}
        rows = [row for _, rows_of, _ in inputs.spec_rows for row in rows_of]
        logits = self.model.compute_logits(hidden[to_device(torch.tensor(rows), self.device)])
        return rejection.verify(logits, [(state, drafts) for state, _, drafts in inputs.spec_rows],
                                inputs.spec_grammar_bitmasks)

    def _readouts(self, hidden: torch.Tensor, inputs: StepInputs) -> list[tuple[str, int, torch.Tensor]]:
        """Each readout row's logits (or the asked columns of them), copied to the host at once."""
        if not inputs.readout_rows:
            return []
        rows = to_device(torch.tensor([row for _, _, row in inputs.readout_rows]), self.device)
        logits = self.model.compute_logits(hidden[rows])
        picked = [logits[i] if request.readout_token_ids is None else logits[i, request.readout_token_ids]
                  for i, (request, _, _) in enumerate(inputs.readout_rows)]
        host = torch.cat(picked).cpu().split([row.shape[0] for row in picked])
        return [(request.request_id, position, row) for (request, position, _), row in zip(inputs.readout_rows, host)]

    def prepare_inputs(self, step: StepData) -> StepInputs:
        scheduled = [(self.batch[rid], count) for rid, count in step.scheduled]
        drafts = step.spec_token_ids
        decodes = sorted((s for s in scheduled if s[1] == 1), key=lambda s: s[0].num_computed_tokens)
        speculating = [(state, drafts[state.request_id]) for state, count in scheduled if state.request_id in drafts]
        # prefills whose rows can join the paged rows first (stable: otherwise in scheduling order)
        prefills = sorted((s for s in scheduled if s[1] > 1 and s[0].request_id not in drafts),
                          key=lambda s: not self._paged_prefill(*s))
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        builder = self.backend.metadata_builder(self.block_size, self.device, self.batch.block_table)
        order = decodes + [(state, len(d) + 1) for state, d in speculating] + prefills
        inputs = StepInputs(torch.empty(0), torch.empty(0), None, order)
        if self.capture is not None:
            inputs.row_keys = []
        self._add_decodes(decodes, speculating, inputs, builder, token_ids, positions, slots)
        for state, count in prefills:
            self._add_prefill(state, count, inputs, builder, token_ids, positions, slots)
        stage, long = self.staging.stage, torch.long
        inputs.input_ids = stage(token_ids, long)
        inputs.positions = stage(torch.cat(positions), long)
        inputs.meta = builder.build(stage(torch.cat(slots), long), stage)
        if inputs.sample_rows:
            inputs.sample_rows_device = stage(inputs.sample_rows, long)
        if inputs.in_flight_rows:
            inputs.in_flight_pairs = stage(self._in_flight_pairs(inputs), long, (2, len(inputs.in_flight_rows)))
        self.staging.flush()
        self._note_grammar(step, inputs)
        inputs.spec_grammar_bitmasks = step.spec_grammar_bitmasks
        return inputs

    def _in_flight_pairs(self, inputs: StepInputs) -> list[list[int]]:
        """[2, k]: the in-flight rows, and the rows of the previous step's samples holding their tokens."""
        if self._last_sampled is None:
            raise RuntimeError("a step's input token is in flight, but the step before it sampled nothing")
        row_of = self._last_sampled[1]
        return [[row for row, _ in inputs.in_flight_rows], [row_of[rid] for _, rid in inputs.in_flight_rows]]

    def _paged_prefill(self, state: CachedRequestState, count: int) -> bool:
        return state.num_computed_tokens + count <= self.backend.paged_prefill_max_context

    def _add_decodes(self, decodes, speculating, inputs, builder, token_ids, positions, slots) -> None:
        """One row per decoding request, and per speculating request its last known token and each
        draft as decode rows (row j attends to the context up to its own position: the step writes
        every row's keys before any row attends), all sorted by context length as the paged decode
        groups want. (This loop runs for every request at every step: names are bound outside it.)"""
        bs, rope_positions, add_decode = self.block_size, self.model.rotary.rope_positions, builder.add_decode
        rows = [(state.num_computed_tokens, state, None) for state, _ in decodes]
        for state, drafts in speculating:
            first, rows_of = state.num_computed_tokens, []
            inputs.spec_rows.append((state, rows_of, drafts))
            rows.extend((first + j, state, rows_of) for j in range(len(drafts) + 1))
        if speculating:
            rows.sort(key=lambda row: row[0])
        drafts_of = {state.request_id: drafts for state, drafts in speculating}
        pos_list, slot_list, keys = [], [], inputs.row_keys
        for pos, state, rows_of in rows:
            table = state.block_ids
            if rows_of is None:
                token = state.token_ids[pos]
                if token == IN_FLIGHT_TOKEN:
                    inputs.in_flight_rows.append((len(token_ids), state.request_id))
            else:
                first = state.num_computed_tokens
                token = state.token_ids[pos] if pos == first else drafts_of[state.request_id][pos - first - 1]
                rows_of.append(len(token_ids))
            token_ids.append(token)
            if keys is not None:
                keys.append((state.request_id, pos))
            pos_list.append(rope_positions(state.num_prompt_tokens, pos))
            slot_list.append(table[pos // bs] * bs + pos % bs)
            add_decode(pos + 1, table, state.table_row)
            if rows_of is None:
                self._note_outputs(state, 1, inputs, row=len(token_ids) - 1)
        positions.append(torch.tensor(pos_list, dtype=torch.long))
        slots.append(torch.tensor(slot_list, dtype=torch.long))

    def _add_prefill(self, state: CachedRequestState, count: int, inputs, builder, token_ids, positions, slots) -> None:
        bs = self.block_size
        first = state.num_computed_tokens
        start_row = len(token_ids)
        token_ids.extend(state.token_ids[first:first + count])
        if inputs.row_keys is not None:
            inputs.row_keys.extend((state.request_id, p) for p in range(first, first + count))
        if IN_FLIGHT_TOKEN in token_ids[start_row:]:
            raise RuntimeError(f"request {state.request_id!r}: a prefill chunk holds a token still in flight")
        pos = torch.arange(first, first + count, dtype=torch.long)
        context_len = first + count
        table = state.block_ids[:-(-context_len // bs)]
        positions.append(self.model.rotary.rope_positions(state.num_prompt_tokens, pos))
        slots.append(torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs)
        builder.add_prefill(start_row, context_len, count, table, state.table_row)
        self._note_outputs(state, count, inputs, row=start_row + count - 1)

    @staticmethod
    def _note_outputs(state: CachedRequestState, count: int, inputs: StepInputs, row: int) -> None:
        """`row` is the flat-batch row of the chunk's last token, at position first_pos + count - 1."""
        first_pos = state.num_computed_tokens
        if state.prompt_logprob_ids is not None:
            first_row = row - count + 1
            inputs.prompt_logprob_rows.extend(prompt_logprobs.rows_for(state, first_pos, count, first_row))
        if state.prefill_only:
            last_pos = first_pos + count - 1
            for pos in state.logits_positions or ():
                if first_pos <= pos <= last_pos:
                    inputs.readout_rows.append((state, pos, row - (last_pos - pos)))
        elif first_pos + count == state.num_tokens:  # the chunk reaches the last known token: it samples
            inputs.sample_rows.append(row)
            inputs.sample_requests.append(state)

    @staticmethod
    def _note_grammar(step: StepData, inputs: StepInputs) -> None:
        if step.grammar_bitmask is None:
            return
        row_of = {state.request_id: i for i, state in enumerate(inputs.sample_requests)}
        inputs.grammar_rows = [row_of[rid] for rid in step.grammar_req_ids]
        inputs.grammar_bitmask = step.grammar_bitmask


def _fill_in_flight(states: list[CachedRequestState], positions: list[int], token_ids: list[int]) -> None:
    """The runner's own copies of tokens it was given in flight, now known."""
    for state, position, token_id in zip(states, positions, token_ids):
        if position < len(state.token_ids) and state.token_ids[position] == IN_FLIGHT_TOKEN:
            state.token_ids[position] = token_id
