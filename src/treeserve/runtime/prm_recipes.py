"""How a process reward model reads a (question, steps) pair: the token ids and where to look.

A recipe returns the token ids to prefill and, for every step, the position whose next-token
logits hold the verdict; the step's score is softmax over the (good, bad) token logits there.
Each recipe writes the whole text once, knowing the character span of every verdict marker in it
(the assistant's `+`, the step tag, the step delimiter), and tokenizes it once with character
offsets (so it needs a fast tokenizer) to find the marker's token. Prefixes are never tokenized
apart: a tokenizer may split text at the end of a prefix unlike inside the whole (GPT-2's
byte-level pre-tokenizer keeps "\n\n" whole at the end of a text but splits "\n\n+" as "\n",
"\n", "+"). A marker that shares its last token with the text after it is a ValueError.
The first three read a language model's next-token logits (softmax over the good and bad verdict
tokens); `lm-likelihood` reads a language model's probability of every token of a step (a model
judging steps by how likely it finds them); `qwen-prm` and `value-head` read a reward head's outputs (model/heads.py) at each step's
separator: softmax's positive class, or the sigmoid of one value. A recipe names the head it
reads (`head`), and `score` turns what is read at a step into its score.
A model directory may name its recipe in its `config.json` (`"prm_recipe": "chat-steps"`); it is
used wherever no recipe is given (for a reward-head architecture, its own recipe is the default). (Its `"prm_aggregation"`, how search turns step scores into one,
is search's to read: `treeserve.search.config.declared_aggregation`.)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class PRMInput:
    token_ids: list[int]
    verdict_positions: list[int]  # one per step: logits at this position predict the verdict token
    # a likelihood recipe's reads, per step: (position, token ids) pairs; the logits at the position
    # give the probability of the next token being one of the ids
    reads: list[list[tuple[int, tuple[int, ...]]]] | None = None

    def positions_of(self, step: int) -> list[int]:
        """The positions whose logits step `step`'s score needs."""
        if self.reads is None:
            return [self.verdict_positions[step]]
        return [position for position, _ in self.reads[step]]


@dataclass(frozen=True)
class Rendered:
    """A recipe's whole text before it is tokenized: the character span of each step's marker in
    it (what `read` looks for in the tokens), and whether the tokenizer adds its special tokens."""
    text: str
    spans: list[tuple[int, int]]
    add_special_tokens: bool = False


class _TextRecipe:
    """A recipe that writes its whole text (`render`), then reads the tokens of that text (`read`):
    `build` makes one input; `build_many` tokenizes many such texts in one call."""

    def build(self, tokenizer, question: str, steps: list[str]) -> PRMInput:
        rendered = self.render(tokenizer, question, steps)
        return self.read(tokenizer, rendered, _Tokenized.encode_many(tokenizer, [rendered], self.name)[0])


def build_many(recipe, tokenizer, items: list[tuple[str, list[str]]]) -> list[PRMInput]:
    """Each (question, steps) item's input, as `recipe.build` makes it, with their texts tokenized
    in one call (a fast tokenizer encodes a batch on all its threads, and the wrapper's per-call work
    is done once: 16 texts of ~600 tokens, 4.9 -> 3.0 ms on 2 cores)."""
    if not isinstance(recipe, _TextRecipe):
        return [recipe.build(tokenizer, question, steps) for question, steps in items]
    rendered = [recipe.render(tokenizer, question, steps) for question, steps in items]
    tokens = _Tokenized.encode_many(tokenizer, rendered, recipe.name)
    return [recipe.read(tokenizer, r, t) for r, t in zip(rendered, tokens)]


@dataclass(frozen=True)
class _VerdictTokens:
    good_token: str = "+"
    bad_token: str = "-"
    head = "lm"
    reads_step_tokens = False  # one verdict position a step, after the step

    def candidate_ids(self, tokenizer) -> tuple[int, int]:
        """The columns read at each verdict position (here the good and bad tokens' logits)."""
        return _single_token(tokenizer, self.good_token), _single_token(tokenizer, self.bad_token)

    @staticmethod
    def score(readout: torch.Tensor) -> float:
        """A step's score from its verdict position's columns: P(good) against bad."""
        return float(torch.softmax(readout.float(), dim=-1)[0])


@dataclass(frozen=True)
class RLHFlowRecipe(_VerdictTokens, _TextRecipe):
    """Multi-turn chat: (question + step 1) as user, `+` as assistant, next step as user, ...

    The score of step k is P(`+`) against `-` where the assistant's k-th verdict is predicted: at
    the token before that `+`, which must be a token of its own in the rendered conversation.
    """
    name: str = "rlhflow"

    def read(self, tokenizer, rendered: Rendered, tokens: _Tokenized) -> PRMInput:
        good = self.candidate_ids(tokenizer)[0]
        positions = []
        for start, end in rendered.spans:
            index = tokens.token_ending_at(end, f"verdict {self.good_token!r}")
            if tokens.offsets[index][0] != start or tokens.token_ids[index] != good:
                raise ValueError(f"prm recipe {self.name}: the verdict {self.good_token!r} is not a token of its own "
                                 f"in the rendered conversation: its token is {tokens.held(index)!r}")
            positions.append(index - 1)
        return PRMInput(tokens.token_ids, positions)

    def render(self, tokenizer, question: str, steps: list[str]) -> Rendered:
        """The conversation rendered once, and where each assistant verdict sits in it: the verdict
        turns are rendered as a character found nowhere else, then that character is replaced."""
        placeholder = _unused_character([question, *steps])
        conversation: list[dict] = []
        for index, step in enumerate(steps):
            conversation.append({"role": "user", "content": f"{question} {step}" if index == 0 else step})
            conversation.append({"role": "assistant", "content": placeholder})
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
        pieces = rendered.split(placeholder)
        if len(pieces) != len(steps) + 1:
            raise ValueError(f"prm recipe {self.name}: the chat template renders {len(pieces) - 1} verdict turns for "
                             f"{len(steps)} steps; it must render every assistant turn's content as given")
        spans, offset = [], 0
        for piece in pieces[:-1]:
            offset += len(piece)
            spans.append((offset, offset + len(self.good_token)))
            offset += len(self.good_token)
        return Rendered(self.good_token.join(pieces), spans)


@dataclass(frozen=True)
class MathShepherdRecipe(_VerdictTokens, _TextRecipe):
    """Question and steps as plain text, each step followed by the step tag `ки`; step k's verdict
    is read at the (last) token of its tag."""
    step_tag: str = "ки"
    name: str = "math-shepherd"

    def render(self, tokenizer, question: str, steps: list[str]) -> Rendered:
        text, spans = f"{question} ", []
        for index, step in enumerate(steps):
            text += f"{step} "
            spans.append((len(text), len(text) + len(self.step_tag)))
            text += self.step_tag + ("\n" if index + 1 < len(steps) else "")
        return Rendered(text, spans, add_special_tokens=True)

    @staticmethod
    def read(tokenizer, rendered: Rendered, tokens: _Tokenized) -> PRMInput:
        return PRMInput(tokens.token_ids, _marker_ends(tokens, rendered.spans, "step tag"))


@dataclass(frozen=True)
class ChatStepsRecipe(_VerdictTokens, _TextRecipe):
    """The question as the user turn and the solution as the assistant turn, exactly as the
    generator writes it: steps joined by the step delimiter. Step k's verdict is read at the last
    token of the delimiter after it (a separator-token PRM, like Qwen2.5-Math-PRM's, whose
    separator is the generator's own). The verifier reads the text in the format its base model
    learnt to compute in, so it can check each result by computing it.
    """
    step_delimiter: str = "\n\n"
    name: str = "chat-steps"

    def render(self, tokenizer, question: str, steps: list[str]) -> Rendered:
        return _assistant_steps(tokenizer, [{"role": "user", "content": question}], steps, self.step_delimiter)

    @staticmethod
    def read(tokenizer, rendered: Rendered, tokens: _Tokenized) -> PRMInput:
        return PRMInput(tokens.token_ids, _marker_ends(tokens, rendered.spans, "step delimiter"))


@dataclass(frozen=True)
class LikelihoodRecipe(_TextRecipe):
    """A language model judging steps by its own likelihood: the question as the user turn and the
    solution as the assistant turn, steps joined by the step delimiter (as the generator writes it,
    like `chat-steps`), and step k's score is the lowest probability the model gives any of its
    tokens, the step's end included (the delimiter's first token or the end of the turn: either
    ends a step). A slip the model would not have written (a wrong digit, operand or step number, a
    step cut short) is an improbable token. The model must know the task better than the generator
    it checks: a generator's own confident slips are probable under itself.

    Reads whole logit rows at every token of a step (`candidate_ids` is None): meant for small
    vocabularies such as the bundled models'; the first read of step k sits at the last token of
    step k-1 (`reads_step_tokens`: a kept conversation is forked only up to the step before)."""
    step_delimiter: str = "\n\n"
    name: str = "lm-likelihood"
    head = "lm"
    reads_step_tokens = True

    @staticmethod
    def candidate_ids(tokenizer) -> None:
        return None  # whole rows: each position reads its own tokens

    @staticmethod
    def score_reads(rows: list[tuple[torch.Tensor, tuple[int, ...]]]) -> float:
        """The lowest, over the step's reads, probability of the token (or any of the tokens) read."""
        return min(float(torch.softmax(row.float(), dim=-1)[list(ids)].sum()) for row, ids in rows)

    def render(self, tokenizer, question: str, steps: list[str]) -> Rendered:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"prm recipe {self.name}: the tokenizer has no end-of-sequence token to end a step with")
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        spans = []
        for step in steps:
            spans.append((len(text), len(text) + len(step)))
            text += step + self.step_delimiter
        return Rendered(text, spans)

    def read(self, tokenizer, rendered: Rendered, tokens: _Tokenized) -> PRMInput:
        reads = [self._step_reads(tokens, start, end, tokenizer.eos_token_id) for start, end in rendered.spans]
        return PRMInput(tokens.token_ids, [step[-1][0] for step in reads], reads)

    def _step_reads(self, tokens: _Tokenized, start: int, end: int, eos: int) -> list[tuple[int, tuple[int, ...]]]:
        """(position before each token of the step, that token), then the step's end: the
        delimiter's first token or the end of the turn."""
        first, ender = tokens.token_starting_at(start), tokens.token_starting_at(end)
        if first is None or ender is None:
            raise ValueError(f"prm recipe {self.name}: a step or its delimiter {self.step_delimiter!r} does not "
                             "start a token of its own, so the step's tokens cannot be read apart from the text around it")
        reads = [(index - 1, (tokens.token_ids[index],)) for index in range(first, ender)]
        return reads + [(ender - 1, (tokens.token_ids[ender], eos))]


@dataclass(frozen=True)
class QwenPRMRecipe(_TextRecipe):
    """Qwen2.5-Math-PRM's: system prompt, the question as the user turn, the steps as the assistant
    turn each followed by the separator token `<extra_0>`; step k's score is the two-class head's
    P(label 1) at its separator. The text ends at the last separator (what would follow, the turn's
    end, cannot change a causal model's outputs before it), so steps 1..k are a prefix of 1..k+1."""
    system_prompt: str = "Please reason step by step, and put your final answer within \\boxed{}."
    separator: str = "<extra_0>"
    name: str = "qwen-prm"
    head = "classify"
    reads_step_tokens = False

    @staticmethod
    def candidate_ids(tokenizer) -> tuple[int, int]:
        return 1, 0  # the head's positive then negative label

    @staticmethod
    def score(readout: torch.Tensor) -> float:
        return float(torch.softmax(readout.float(), dim=-1)[0])

    def render(self, tokenizer, question: str, steps: list[str]) -> Rendered:
        _single_token(tokenizer, self.separator)
        turns = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]
        return _assistant_steps(tokenizer, turns, steps, self.separator)

    @staticmethod
    def read(tokenizer, rendered: Rendered, tokens: _Tokenized) -> PRMInput:
        return PRMInput(tokens.token_ids, _marker_ends(tokens, rendered.spans, "step separator"))


@dataclass(frozen=True)
class ValueHeadRecipe:
    """Skywork's PRMs' (a value head): the BOS token's text, the question and a newline, then each
    step tokenized on its own followed by the step token (a newline's last token); step k's score
    is the sigmoid of the head's value at its step token. Pieces are tokenized apart, as Skywork's
    own input code does, so steps 1..k are a prefix of 1..k+1 whatever the tokenizer."""
    step_token: str = "\n"
    name: str = "value-head"
    head = "value"
    reads_step_tokens = False

    @staticmethod
    def candidate_ids(tokenizer) -> tuple[int]:
        return (0,)

    @staticmethod
    def score(readout: torch.Tensor) -> float:
        return 1.0 / (1.0 + math.exp(-float(readout[0])))

    def build(self, tokenizer, question: str, steps: list[str]) -> PRMInput:
        step_id = tokenizer.encode(self.step_token, add_special_tokens=False)[-1]
        ids = tokenizer.encode((tokenizer.bos_token or "") + question + "\n", add_special_tokens=False)
        positions = []
        for step in steps:
            ids += tokenizer.encode(step, add_special_tokens=False) + [step_id]
            positions.append(len(ids) - 1)
        return PRMInput(ids, positions)


def read_columns(recipe, tokenizer) -> list[int] | None:
    """The logit columns a recipe reads at its positions, or None for whole rows (lm-likelihood)."""
    candidates = recipe.candidate_ids(tokenizer)
    return None if candidates is None else list(candidates)


RECIPES = {"rlhflow": RLHFlowRecipe(), "math-shepherd": MathShepherdRecipe(), "chat-steps": ChatStepsRecipe(),
           "lm-likelihood": LikelihoodRecipe(), "qwen-prm": QwenPRMRecipe(), "value-head": ValueHeadRecipe()}
DEFAULT_RECIPE = "rlhflow"
CONFIG_KEY = "prm_recipe"
HEAD_RECIPES = {"Qwen2ForProcessRewardModel": "qwen-prm", "Qwen2ForPrmModel": "value-head"}


def declared_recipe(model_dir: str | Path, default: str | None = DEFAULT_RECIPE) -> str | None:
    """The recipe a model directory names in its config.json, else its reward head's own, else
    `default` (RLHFlow's; None: the model declares itself no verifier, runtime/roles.py)."""
    config = Path(model_dir) / "config.json"
    raw = json.loads(config.read_text()) if config.is_file() else {}
    default = HEAD_RECIPES.get((raw.get("architectures") or [None])[0], default)
    name = raw.get(CONFIG_KEY, default)
    if name is not None and name not in RECIPES:
        raise ValueError(f"{config}: unknown {CONFIG_KEY} {name!r}; known: {', '.join(RECIPES)}")
    return name


def check_recipe_fits(recipe, model_config) -> None:
    """A recipe reads the head it was made for: a language model's logits or a reward head."""
    if recipe.head != model_config.head:
        what = {"lm": "a language model's next-token logits", "classify": "a two-class reward head",
                "value": "a value head"}
        raise ValueError(f"prm recipe {recipe.name} reads {what[recipe.head]}, and this model "
                         f"({model_config.architecture}) has {what[model_config.head]}")


def _assistant_steps(tokenizer, turns: list[dict], steps: list[str], marker: str) -> Rendered:
    """The turns through the chat template up to the assistant's turn, then the steps each followed
    by `marker` (each step's verdict is read at the marker's last token)."""
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    spans = []
    for step in steps:
        text += step
        spans.append((len(text), len(text) + len(marker)))
        text += marker
    return Rendered(text, spans)


def _marker_ends(tokens: _Tokenized, spans: list[tuple[int, int]], marker: str) -> list[int]:
    """For each marker (step tag, step delimiter), the token holding its last character: where a
    tag or separator PRM reads its verdict. That token may also hold text before the marker (a
    space, a full stop), but it must hold the same share of the marker at every step: otherwise a
    step would be read at another token once a step follows it (as with a tokenizer that merges
    "\\n\\n" at the end of a text but not before more text)."""
    ends = [tokens.token_ending_at(end, marker) for _, end in spans]
    shares = {end - max(start, tokens.offsets[index][0]) for index, (start, end) in zip(ends, spans)}
    if len(shares) > 1:
        held = " or ".join(map(str, sorted(shares)))
        raise ValueError(f"prm recipe {tokens.recipe}: the {marker} {tokens.text[slice(*spans[0])]!r} does not "
                         f"tokenize the same after every step (the token read holds {held} of its characters), "
                         "so a step's verdict would depend on whether a step follows it")
    return ends


class _Tokenized:
    """A recipe's full text tokenized once, with the character span of each token."""

    def __init__(self, text: str, recipe: str, token_ids: list[int], offsets: list[tuple[int, int]]):
        self.text, self.recipe = text, recipe
        self.token_ids = token_ids
        self.offsets: list[tuple[int, int]] = [tuple(span) for span in offsets]
        self._holder = [-1] * len(text)  # the last token holding each character
        for index, (start, end) in enumerate(self.offsets):
            self._holder[start:end] = [index] * (end - start)

    @classmethod
    def encode_many(cls, tokenizer, texts: list[Rendered], recipe: str) -> list["_Tokenized"]:
        """The texts tokenized in one call per `add_special_tokens` value, with character offsets."""
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"prm recipe {recipe}: needs a fast tokenizer, which maps tokens to characters; "
                             f"{type(tokenizer).__name__} is not one")
        tokenized: list[_Tokenized | None] = [None] * len(texts)
        for special in {t.add_special_tokens for t in texts}:
            rows = [i for i, t in enumerate(texts) if t.add_special_tokens == special]
            encoding = tokenizer([texts[i].text for i in rows], add_special_tokens=special,
                                 return_offsets_mapping=True)
            for i, ids, offsets in zip(rows, encoding["input_ids"], encoding["offset_mapping"]):
                tokenized[i] = cls(texts[i].text, recipe, ids, offsets)
        return tokenized

    def token_ending_at(self, end: int, marker: str) -> int:
        """The token holding the character before `end`, which must end there: a token running on
        into the text after it would make the verdict position read that text too."""
        index = self._holder[end - 1]
        if index < 0 or self.offsets[index][1] != end:
            raise ValueError(f"prm recipe {self.recipe}: the {marker} shares its last token with the text after "
                             f"it, so no position reads it alone: that token is {self.held(index)!r}")
        return index

    def token_starting_at(self, start: int) -> int | None:
        """The token whose first character is at `start`, if one is."""
        index = self._holder[start] if start < len(self._holder) else -1
        return index if index >= 0 and self.offsets[index][0] == start else None

    def held(self, index: int) -> str:
        return self.text[slice(*self.offsets[index])] if index >= 0 else ""


def _unused_character(texts: list[str]) -> str:
    used = set().union(*texts)
    return next(c for c in map(chr, range(0xE000, 0xF900)) if c not in used)  # Unicode's private use area


def _single_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"prm recipe: verdict token {text!r} is {len(ids)} tokens for this tokenizer, expected 1")
    return ids[0]
