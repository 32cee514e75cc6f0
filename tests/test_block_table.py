"""The runner's block tables as numpy rows: they equal the lists they mirror through any sequence of
adds, appends, copied-on-write tails, removals and growth, and the Triton metadata gathered from
them equals the padded lists it replaced."""
import random

import numpy as np
import torch

from treeserve.engine.block_table import BlockTable
from treeserve.engine.input_batch import InputBatch
from treeserve.engine.step_data import CachedRequestData, NewRequestData, StepData
from treeserve.model.triton_backend import TritonMetadataBuilder
from treeserve.sampling_params import SamplingParams


def _new(req_id: str, blocks: list[int]) -> NewRequestData:
    return NewRequestData(req_id, [1, 2, 3], 3, blocks, 0, SamplingParams(), (), False, None, None, None)


def test_rows_follow_every_change_and_grow():
    rng = random.Random(0)
    batch, lists = InputBatch(), {}
    batch.block_table = BlockTable(rows=2, width=2)  # (small: growth in both directions happens)
    next_id = 0
    for _ in range(400):
        step = StepData()
        live = list(lists)
        if live and rng.random() < 0.2:
            gone = rng.choice(live)
            step.finished_req_ids.append(gone)
            del lists[gone]
        if rng.random() < 0.3 or not lists:
            rid = f"r{next_id}"
            next_id += 1
            lists[rid] = [rng.randrange(1000) for _ in range(rng.randint(0, 5))]
            step.new_requests.append(_new(rid, lists[rid]))
        for rid in [r for r in lists if r not in {n.req_id for n in step.new_requests}]:
            keep = rng.randint(max(0, len(lists[rid]) - 1), len(lists[rid]))  # a copied-on-write tail, or none
            added = [rng.randrange(1000) for _ in range(rng.choice((0, 0, 1, 3)))]
            lists[rid] = lists[rid][:keep] + added
            step.cached_requests.append(CachedRequestData(rid, [], keep, added, 0))
        batch.update(step)
        for rid, blocks in lists.items():
            state = batch[rid]
            assert state.block_ids == blocks
            assert batch.block_table.table[state.table_row, :len(blocks)].tolist() == blocks
        rows = [batch[rid].table_row for rid in lists]
        assert len(set(rows)) == len(rows) == batch.block_table.num_rows_in_use
    assert batch.block_table.table.shape[0] >= 4 and batch.block_table.table.shape[1] >= 8


def test_triton_tables_from_rows_equal_the_padded_lists():
    table = BlockTable(rows=4, width=4)
    lists = [[5, 6, 7, 8, 9], [1], [2, 3, 4]]
    rows = [table.add(blocks) for blocks in lists]
    seq_lens = [70, 3, 33]  # block size 16: 5, 1 and 3 blocks
    gathered, padded = (TritonMetadataBuilder(None, torch.device("cpu"), 16, table),
                        TritonMetadataBuilder(None, torch.device("cpu"), 16, None))
    for builder in (gathered, padded):
        for blocks, row, n in zip(lists, rows, seq_lens):
            builder.add_prefill(0, n, 2, blocks + [99], row)  # (a table may run past the context)
    from_rows, from_lists = gathered._tables(5), padded._tables(5)
    assert from_lists.tolist() == [[5, 6, 7, 8, 9], [1, 0, 0, 0, 0], [2, 3, 4, 0, 0]]
    for i, n in enumerate(seq_lens):  # (past its context a row holds whatever; no kernel reads it)
        needed = -(-n // 16)
        assert np.array_equal(from_rows[i, :needed], from_lists[i, :needed])
