"""The proposers that run passes of their own, by method: made for an engine (`make_drafter`), and
whether one can draft for a model at all (`drafts_for`: a `Runtime` gives a drafter only to the
models it fits)."""
from __future__ import annotations

from treeserve.engine.kv_space import KVSpace
from treeserve.engine.loaded_model import LoadedModel
from treeserve.engine.spec_decode.draft_model import DraftModelProposer, draft_tokenizer, shares_tokenizer
from treeserve.engine.spec_decode.eagle import EagleProposer
from treeserve.model.eagle import read_eagle_config
from treeserve.model.registry import resolve_model_path
from treeserve.speculative_config import SpeculativeConfig


def make_drafter(config: SpeculativeConfig, target: LoadedModel, space: KVSpace):
    if config.method == "draft_model":
        return DraftModelProposer(config, target, space)
    return EagleProposer(config, target, space)


def drafts_for(config: SpeculativeConfig, target: LoadedModel) -> bool:
    """A draft model shares the target's tokenizer; an EAGLE head reads the target's width."""
    if config.method == "draft_model":
        return shares_tokenizer(draft_tokenizer(config), target)
    try:
        read_eagle_config(resolve_model_path(config.model), config.method, target.model_config)
    except ValueError:
        return False
    return True
