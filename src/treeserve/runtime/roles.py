"""Which served models verify (a step scorer may read them) and which generate.

A model is a verifier when it has a reward head (its architecture's own recipe), when its
config.json names its `prm_recipe` (the bundled arith-prm: `lm-likelihood`), or when whoever serves
it says so (`treeserve serve --verifier NAME[=RECIPE]`, `treeserve search --verifier PATH`, an
offline `Runtime(..., recipes={NAME: RECIPE or None})`). A plain language model that declares
nothing is a generator only: RLHFlow's PRMs declare nothing either, so no config check can tell
one from a generator, and a generator read by RLHFlow's recipe gives near-constant scores from
`+`/`-` logits it never learnt, with no error. A model with a reward head computes no next-token
logits, so it is no generator.
"""
from __future__ import annotations

import logging
from pathlib import Path

from treeserve.runtime.prm_recipes import CONFIG_KEY, DEFAULT_RECIPE, declared_recipe

logger = logging.getLogger(__name__)

SERVED_AS_VERIFIER = "is served as one with --verifier NAME[=RECIPE]"


def verifier_recipe(model_dir: str | Path, named: bool, recipe: str | None = None) -> str | None:
    """The recipe the model is read by as a verifier, or None when it is no verifier. `named`: whoever
    serves it named it a verifier (with `recipe`, or None for its declared one, else RLHFlow's)."""
    if recipe:
        return recipe
    declared = declared_recipe(model_dir, default=None)
    if declared is None and named:
        # (said, not refused: RLHFlow's PRMs declare nothing; a generator named here scores nonsense)
        logger.warning("verifier %s: its config.json names no %s and it has no reward head; reading it with the "
                       "default recipe, %s (P(+) against - after each step), which only a PRM trained for it "
                       "can answer", Path(model_dir).name, CONFIG_KEY, DEFAULT_RECIPE)
        return DEFAULT_RECIPE
    return declared


def is_generator(model_config) -> bool:
    """Whether the model computes next-token logits to sample from (a reward head does not)."""
    return model_config.head == "lm"


def not_a_verifier(name: str, verifiers: list[str], how: str = SERVED_AS_VERIFIER) -> str:
    """Why `name` cannot be read as a verifier, what is served as one, and `how` a PRM that
    declares nothing becomes one."""
    served = ", ".join(verifiers) or "none"
    return (f"'{name}' is not served as a verifier (served verifiers: {served}): it is a language model with no "
            f"reward head whose config.json names no {CONFIG_KEY}, so its logits hold no step verdicts; a process "
            f"reward model whose config.json names no recipe (RLHFlow's) {how}")


def not_a_generator(name: str, architecture: str) -> str:
    return (f"'{name}' is a process reward model ({architecture}): it scores steps (/v1/rewards, a search's "
            "verifier) and generates nothing")


def no_generator_served(architectures: dict[str, str]) -> str:
    """Why a request that names no model has no generator to go to: each served model (name ->
    architecture) is a reward model (the same sentence as for one named)."""
    return "no generator is served: " + "; ".join(not_a_generator(name, arch) for name, arch in architectures.items())


def no_verifier_served(names: list[str]) -> str:
    """Why a scoring request that names no model has no reward model to go to."""
    served = ", ".join(f"'{name}'" for name in names)
    return (f"no reward model is served ({served}: no reward head, and no {CONFIG_KEY} in its config.json); a process "
            f"reward model whose config.json names no recipe (RLHFlow's) {SERVED_AS_VERIFIER}")
