"""A step's index tensors go to the device through persistent staging buffers, one copy per dtype per
step (on CUDA, pinned and double-buffered). On CPU the same offsets and copies run when forced
(`always`): views hold what was staged, growth mid-step loses nothing, and an engine whose steps
go through them (async scheduling: in-flight tokens too) gives the outputs of one that does not."""
import numpy as np
import torch

from conftest import assert_no_leak
from test_async_scheduling import OPTIONS, _assert_same
from test_async_output import PROMPTS, _params
from treeserve import LLM
from treeserve.model.transfer import StepStaging


def test_staged_views_hold_their_values_through_growth_and_reuse():
    staging = StepStaging(torch.device("cpu"), always=True)
    staging.INITIAL_ELEMENTS = 8
    for step in range(3):
        values = [(list(range(step, step + 5)), torch.long, None),
                  (np.arange(6, dtype=np.int32).reshape(2, 3), torch.int32, (2, 3)),
                  (torch.tensor([[1, 2], [3, 4], [5, 6]]).T, torch.long, (2, 3)),  # (not contiguous)
                  (torch.arange(7) * 10 + step, torch.long, None)]  # (the int64 buffer of 8 overflows: it grows)
        views = [staging.stage(v, dtype, shape) for v, dtype, shape in values]
        staging.flush()
        for (v, dtype, shape), view in zip(values, views):
            assert view.dtype == dtype and torch.equal(view, torch.as_tensor(np.asarray(v), dtype=dtype))
            assert view.data_ptr() % 16 == 0  # (Triton specializes kernels on 16-byte aligned pointers)
    # steps 1 and 2: the int64 buffer (8, then 16 elements) overflows and is flushed before it grows,
    # then both dtypes are copied; step 3 fits (32): one copy per dtype
    assert staging.num_copies == 3 + 3 + 2
    plain = StepStaging(torch.device("cpu"))  # (CPU, not forced: tensors of the values, no copies)
    assert not plain.active and torch.equal(plain.stage([[1, 2]], torch.int32, (2,)), torch.tensor([1, 2],
                                                                                                 dtype=torch.int32))


def test_an_engine_stepping_through_staging_gives_the_same_outputs(tiny_model_dirs):
    path = str(tiny_model_dirs["llama"])
    expected = LLM(path, async_scheduling=False, **OPTIONS).generate(PROMPTS, _params(), use_tqdm=False)
    llm = LLM(path, async_scheduling=True, **OPTIONS)
    runner = llm.engine.runner
    runner.staging = StepStaging(torch.device("cpu"), always=True)
    _assert_same(llm.generate(PROMPTS, _params(), use_tqdm=False), expected)
    steps = llm.engine.num_steps
    assert llm.engine.stats().num_steps_left_running > 0  # (in-flight tokens were staged too)
    assert steps <= runner.staging.num_copies <= 2 * steps  # one copy per dtype per step (int64 and int32 here)
    assert_no_leak(llm.engine)
