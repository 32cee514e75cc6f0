"""How a process reward model reads a (question, steps) pair: the token ids and where to look.

A recipe returns the token ids to prefill and, for every step, the position whose next-token
logits hold the verdict; the step's score is softmax over the (good, bad) token logits there.
A model directory may name its recipe in its `config.json` (`"prm_recipe": "chat-steps"`); it is
used wherever no recipe is given. Likewise `"prm_aggregation"` names how search turns the PRM's step
scores into one score where a request names none: `last` (Search-and-Learn's default, for a PRM
whose verdict says "right so far"), `min` or `prod` (for one whose verdict judges each step alone).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PRMInput:
    token_ids: list[int]
    verdict_positions: list[int]  # one per step: logits at this position predict the verdict token


@dataclass(frozen=True)
class _VerdictTokens:
    good_token: str = "+"
    bad_token: str = "-"

    def candidate_ids(self, tokenizer) -> tuple[int, int]:
        return _single_token(tokenizer, self.good_token), _single_token(tokenizer, self.bad_token)


@dataclass(frozen=True)
class RLHFlowRecipe(_VerdictTokens):
    """Multi-turn chat: (question + step 1) as user, `+` as assistant, next step as user, ...

    The score of step k is P(`+`) against `-` where the assistant's k-th verdict is predicted.
    """
    name: str = "rlhflow"

    def build(self, tokenizer, question: str, steps: list[str]) -> PRMInput:
        conversation: list[dict] = []
        positions = []
        for index, step in enumerate(steps):
            content = f"{question} {step}" if index == 0 else step
            conversation.append({"role": "user", "content": content})
            prefix = _render(tokenizer, conversation, add_generation_prompt=True)
            positions.append(len(prefix) - 1)
            conversation.append({"role": "assistant", "content": self.good_token})
        token_ids = _render(tokenizer, conversation, add_generation_prompt=False)
        good = self.candidate_ids(tokenizer)[0]
        if any(p + 1 >= len(token_ids) or token_ids[p + 1] != good for p in positions):
            raise ValueError("prm recipe: the chat template does not render the verdict turns as expected")
        return PRMInput(token_ids, positions)


@dataclass(frozen=True)
class MathShepherdRecipe(_VerdictTokens):
    """Question and steps as plain text, each step followed by the step tag `ки`."""
    step_tag: str = "ки"
    name: str = "math-shepherd"

    def build(self, tokenizer, question: str, steps: list[str]) -> PRMInput:
        text = f"{question} "
        prefixes = []
        for index, step in enumerate(steps):
            text += f"{step} {self.step_tag}"
            prefixes.append(tokenizer.encode(text))
            if index + 1 < len(steps):
                text += "\n"
        return _verdicts_at_prefix_ends(tokenizer.encode(text), prefixes, "the step tag")


@dataclass(frozen=True)
class ChatStepsRecipe(_VerdictTokens):
    """The question as the user turn and the solution as the assistant turn, exactly as the
    generator writes it: steps joined by the step delimiter. Step k's verdict is read at the last
    token of the delimiter after it (a separator-token PRM, like Qwen2.5-Math-PRM's, whose
    separator is the generator's own). The verifier reads the text in the format its base model
    learnt to compute in, so it can check each result by computing it.
    """
    step_delimiter: str = "\n\n"
    name: str = "chat-steps"

    def build(self, tokenizer, question: str, steps: list[str]) -> PRMInput:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        prefixes = []
        for step in steps:
            text += step + self.step_delimiter
            prefixes.append(tokenizer.encode(text, add_special_tokens=False))
        token_ids = prefixes[-1] if prefixes else tokenizer.encode(text, add_special_tokens=False)
        return _verdicts_at_prefix_ends(token_ids, prefixes, "the step delimiter")


RECIPES = {"rlhflow": RLHFlowRecipe(), "math-shepherd": MathShepherdRecipe(), "chat-steps": ChatStepsRecipe()}
DEFAULT_RECIPE = "rlhflow"
CONFIG_KEY = "prm_recipe"
AGGREGATION_KEY = "prm_aggregation"
DEFAULT_AGGREGATION = "last"


def declared_recipe(model_dir: str | Path) -> str:
    """The recipe a model directory names in its config.json, else the default (RLHFlow's)."""
    return _declared(model_dir, CONFIG_KEY, DEFAULT_RECIPE, tuple(RECIPES))


def declared_aggregation(model_dir: str | Path) -> str:
    """The step-score aggregation a model directory names in its config.json, else `last`, unchecked:
    search owns the names and checks them (treeserve.search.config.declared_aggregation)."""
    config = Path(model_dir) / "config.json"
    declared = json.loads(config.read_text()) if config.is_file() else {}
    return declared.get(AGGREGATION_KEY, DEFAULT_AGGREGATION)


def _declared(model_dir: str | Path, key: str, default: str, known: tuple[str, ...]) -> str:
    config = Path(model_dir) / "config.json"
    name = json.loads(config.read_text()).get(key, default) if config.is_file() else default
    if name not in known:
        raise ValueError(f"{config}: unknown {key} {name!r}; known: {', '.join(known)}")
    return name


def _verdicts_at_prefix_ends(token_ids: list[int], prefixes: list[list[int]], marker: str) -> PRMInput:
    """Each step's verdict at the last token of the text through it, once every such prefix is
    checked to tokenize the same alone as inside the whole text."""
    if any(token_ids[: len(p)] != p for p in prefixes):
        raise ValueError(f"prm recipe: {marker} does not tokenize the same alone and in context")
    return PRMInput(token_ids, [len(p) - 1 for p in prefixes])


def _render(tokenizer, conversation: list[dict], add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def _single_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"prm recipe: verdict token {text!r} is {len(ids)} tokens for this tokenizer, expected 1")
    return ids[0]
