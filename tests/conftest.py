import os

import pytest
import torch

from treeserve.testing.tiny_models import FAMILIES, make_tiny_model

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    os.environ["TREESERVE_CACHE"] = str(tmp_path_factory.mktemp("treeserve-cache"))


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: make_tiny_model(family, root / family, seed=1) for family in FAMILIES}


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs):
    return tiny_model_dirs["llama"]


def assert_no_leak(engine):
    """Every block is free (possibly still cached): nothing holds a reference after the workload."""
    pool = engine.kv.pool
    assert not engine.scheduler.has_unfinished()
    assert not engine.kv.block_tables, f"block tables left: {list(engine.kv.block_tables)}"
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert pool.num_free == pool.num_blocks
