"""Plain-PyTorch training of the arithmetic task's generator and process reward model, on CPU.

The generator learns the solutions (loss on the assistant turn only). The PRM is trained on steps
the generator itself sampled, labelled by exact checking: its verdict after every step is a two-way
choice between the `+` and `-` tokens, at the positions a recipe of
`treeserve.runtime.prm_recipes` names, read the same way at inference.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from treeserve.runtime.prm_recipes import RECIPES
from treeserve.tasks.arithmetic import (GRID_MAX_OPERATIONS, GRID_OPERATORS, LEVELS, Problem, random_grid_problem,
                                        random_problem, split_of)

IGNORE = -100


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int


GENERATOR_SHAPE = ModelShape(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=384)
PRM_EXTRA_LAYERS = 3  # the PRM is the trained language model grown by this many layers, then trained on verdicts


@dataclass
class Schedule:
    steps: int
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def new_model(tokenizer, shape: ModelShape, seed: int, max_positions: int = 512, tie_embeddings: bool = True):
    """A randomly initialised Llama of `shape`. `tie_embeddings=False` keeps the output matrix apart:
    tokens that are interchangeable wherever they are predicted (a formula's variable names, before a
    model can copy them) have their tied embeddings pulled together (cosine 0.98 in a tool router
    trained tied) and can then no longer be told apart on the way in."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
        tie_word_embeddings=tie_embeddings, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.02)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def grow(model, extra_layers: int, seed: int):
    """A deeper copy of `model` whose new top layers start as the identity (zeroed output projections),
    so it begins with everything the smaller model learnt; a PRM starts from a language model."""
    import copy

    import transformers

    config = copy.deepcopy(model.config)
    config.num_hidden_layers += extra_layers
    torch.manual_seed(seed)
    grown = transformers.LlamaForCausalLM(config)
    missing, unexpected = grown.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(".layers." in name for name in missing), (missing, unexpected)
    with torch.no_grad():
        for layer in grown.model.layers[model.config.num_hidden_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return grown


FORMATS = ("levels", "whole")  # the curriculum's levels, or the whole format (1-8 operations of any mix)


def train_problems(rng: random.Random, n: int, levels: tuple[int, ...] = LEVELS, whole: bool = False,
                   shape: tuple[int, str] | None = None) -> list[Problem]:
    """`n` training-split problems (other splits' problems skipped): each of a level drawn from
    `levels`, or with `whole` of the whole format, each of `shape` (operations, operator set) if
    given, else of a random one."""
    problems = []
    while len(problems) < n:
        if whole:
            count, operators = shape or (rng.randint(1, GRID_MAX_OPERATIONS), rng.choice(GRID_OPERATORS))
            problem = random_grid_problem(rng, count, operators)
        else:
            problem = random_problem(rng, rng.choice(levels))
        if split_of(problem.text) == "train":
            problems.append(problem)
    return problems


def one_level_batch(rng: random.Random, n: int, whole: bool = False) -> list[Problem]:
    """`n` training problems of one random level (with `whole`, of one operation count and operator
    set): equal lengths, so no compute is spent on padding."""
    if whole:
        return train_problems(rng, n, whole=True,
                              shape=(rng.randint(1, GRID_MAX_OPERATIONS), rng.choice(GRID_OPERATORS)))
    return train_problems(rng, n, levels=(rng.choice(LEVELS),))


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def sft_example(tokenizer, problem: Problem) -> tuple[list[int], list[int]]:
    """Token ids of (question, solution) and labels that train on the solution and its end token only."""
    user = [{"role": "user", "content": problem.text}]
    prompt = chat_ids(tokenizer, user, add_generation_prompt=True)
    full = chat_ids(tokenizer, user + [{"role": "assistant", "content": problem.solution}])
    return full, [IGNORE] * len(prompt) + full[len(prompt):]


def prm_example(tokenizer, question: str, steps: list[str], labels: list[bool], results: list[int | None],
                local_labels: list[bool], expected: list[str] | None = None,
                recipe: str = "chat-steps", carry_errors: bool = True,
                operators: list[str | None] | None = None,
                operands: list[int | None] | None = None) -> tuple[list[int], ...]:
    """The ids `recipe` builds (as at inference) and seven kinds of labels:
    - verdicts: 1 where the step is good (`labels`), 0 where it is bad, IGNORE elsewhere;
    - language-model labels on the text through the last good step's verdict position (the PRM
      keeps learning the arithmetic it judges, never from a wrong step);
    - token verdicts (only given the `expected` steps, else all IGNORE): at every token of step k,
      1 if the step so far is a prefix of `expected[k]` (and, with `carry_errors`, every earlier
      step is good), else 0; at the tokens between a step and the next (the verdict position among
      them), the step's label;
    - results: at the verdict position of step k, `results[k]`, the value that step must reach
      (IGNORE where None). An auxiliary head learns to compute it there, so the layers above only
      compare it with the value written (see `prm_loss`);
    - local verdicts: at every verdict position, 1 if the step itself is right given what the step
      before it wrote (`local_step_labels`), learnt by a second auxiliary head;
    - operators: at the verdict position of step k, the index in `OPERATORS` of `operators[k]`, the
      operator the question gives that step (IGNORE where None or not given), learnt by a third
      auxiliary head, so the layers above compare it with the one written;
    - operands: likewise the operand the question gives step k (1-9, as class operand - 1), for a
      fourth head (a wrong operand copied is invisible to a model that never looks it up).
    """
    built = RECIPES[recipe].build(tokenizer, question, steps)
    token_verdicts = ([IGNORE] * len(built.token_ids) if expected is None
                      else _token_verdicts(tokenizer, built.token_ids, question, steps, labels, expected, carry_errors))
    operator_classes = [None if op is None else OPERATORS.index(op) for op in operators or []]
    operand_classes = [None if operand is None else operand - 1 for operand in operands or []]
    return (built.token_ids, _at_verdicts(built, labels), _imitation_labels(built, labels), token_verdicts,
            _at_verdicts(built, results), _at_verdicts(built, local_labels), _at_verdicts(built, operator_classes),
            _at_verdicts(built, operand_classes))


def _at_verdicts(built, targets: list[int | bool | None]) -> list[int]:
    """One target per step at its verdict position (None: IGNORE), IGNORE everywhere else."""
    row = [IGNORE] * len(built.token_ids)
    for position, target in zip(built.verdict_positions, targets):
        if target is not None:
            row[position] = int(target)
    return row


def prm_reading_example(tokenizer, question: str, steps: list[str],
                        recipe: str = "chat-steps") -> tuple[list[int], list[int]]:
    """A right solution as the PRM reads it, with language-model labels only (format adaptation)."""
    built = RECIPES[recipe].build(tokenizer, question, steps)
    return built.token_ids, _imitation_labels(built, [True] * len(steps))


def _imitation_labels(built, labels: list[bool]) -> list[int]:
    """The ids through the last good step's verdict position, IGNORE after: never imitate a wrong step."""
    good_positions = [p for p, good in zip(built.verdict_positions, labels) if good]
    known = good_positions[-1] + 1 if good_positions else 0
    return built.token_ids[:known] + [IGNORE] * (len(built.token_ids) - known)


def _token_verdicts(tokenizer, token_ids: list[int], question: str, steps: list[str], labels: list[bool],
                    expected: list[str], carry_errors: bool = True) -> list[int]:
    text = tokenizer.decode(token_ids)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if len(offsets) != len(token_ids):
        raise ValueError("prm example: the rendered conversation does not re-tokenize to the same ids")
    targets, cursor, token = [IGNORE] * len(token_ids), text.index(question) + len(question), 0
    starts = []
    for step in steps:
        starts.append(text.index(step, cursor))
        cursor = starts[-1] + len(step)
    for index, (step, start) in enumerate(zip(steps, starts)):
        right_before = index == 0 or labels[index - 1] or not carry_errors
        want = expected[index] if index < len(expected) else ""
        following = starts[index + 1] if index + 1 < len(steps) else len(text)
        while token < len(offsets) and offsets[token][0] < following:
            begin, end = offsets[token]
            if begin >= start + len(step):  # between this step and the next: the step's own verdict
                targets[token] = int(labels[index])
            elif begin >= start:
                targets[token] = int(right_before and step[: end - start] == want[: end - start])
            token += 1
    return targets


def collate(examples: list[tuple[list[int], ...]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """(ids, *label rows) per example -> ids, one tensor per kind of labels (IGNORE-padded), mask."""
    width = max(len(example[0]) for example in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = [torch.full((len(examples), width), IGNORE, dtype=torch.long) for _ in examples[0][1:]]
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (token_ids, *targets) in enumerate(examples):
        ids[row, : len(token_ids)] = torch.tensor(token_ids)
        for kind, row_targets in zip(labels, targets):
            kind[row, : len(row_targets)] = torch.tensor(row_targets)
        mask[row, : len(token_ids)] = 1
    return ids, *labels, mask


def lm_loss(model, ids, labels, mask) -> torch.Tensor:
    return _next_token_loss(model(input_ids=ids, attention_mask=mask).logits, labels)


def split_shared_prefix(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """(ids, labels) per example -> the tokens every example opens with, then the rest collated:
    `shared_prefix_loss`'s batch. Examples whose prompts share a long opening (a system prompt) are
    then trained on that opening's cost once, not per row. No token predicted from a prefix position
    is labelled (the prefix's logits are never computed) and every row keeps a token."""
    shortest = min(len(ids) for ids, _ in examples)
    length = 0
    while (length < shortest - 1 and all(ids[length] == examples[0][0][length] for ids, _ in examples)
           and all(labels[length + 1] == IGNORE for _, labels in examples)):
        length += 1
    ids, labels, mask = collate([(ids[length:], labels[length:]) for ids, labels in examples], pad_id)
    return torch.tensor(examples[0][0][:length], dtype=torch.long), ids, labels, mask


def shared_prefix_loss(model, prefix, ids, labels, mask) -> torch.Tensor:
    """`lm_loss` of the rows `prefix + ids[i]`, the prefix run once and its keys and values shared
    (broadcast, so their gradients sum over the rows); the prefix itself carries no labels."""
    if not len(prefix):
        return lm_loss(model, ids, labels, mask)
    cache = model(input_ids=prefix[None], use_cache=True).cache
    for layer in cache.layers:
        layer.keys, layer.values = (t.expand(len(ids), -1, -1, -1) for t in (layer.keys, layer.values))
    positions = torch.arange(len(prefix), len(prefix) + ids.shape[1]).expand(len(ids), -1)
    full_mask = torch.cat([torch.ones(len(ids), len(prefix), dtype=mask.dtype), mask], dim=1)
    logits = model(input_ids=ids, attention_mask=full_mask, cache=cache, position_ids=positions).logits
    return _next_token_loss(logits, labels)


def _next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=IGNORE)


@dataclass(frozen=True)
class PRMLossWeights:
    lm: float = 0.5           # language-model loss on the text before the first wrong step
    token_verdicts: float = 0.0
    bad: float = 1.0          # a wrong verdict target weighs this many times a right one
    result: float = 1.0       # the result head's loss on the value each step must reach
    local: float = 1.0        # the local-verdict head's loss
    operator: float = 0.0     # the operator head's loss on the operator the question gives each step
    operand: float = 0.0      # the operand head's loss on the operand the question gives each step


RESULT_CLASSES = 100  # values modulo 100
OPERATORS = "+-*"  # the operator head's classes
OPERAND_CLASSES = 9  # operands 1-9


class TrainingHeads(torch.nn.Module):
    """Linear read-outs used only in training, each on the hidden state after a given number of
    layers at the verdict positions: the value a step must reach (`result`), after `result_layer`;
    the operator the question gives it (`operator`) and, where asked for, its operand (`operand`), after
    `operator_layer`; whether the step itself is right (`local`), after `local_layer`. Attached to the PRM while it trains (so its optimiser
    sees them), dropped before it is saved: the checkpoint stays a plain LlamaForCausalLM."""

    def __init__(self, hidden_size: int, result_layer: int, local_layer: int, operator_layer: int,
                 operand: bool = False):
        super().__init__()
        self.result = torch.nn.Linear(hidden_size, RESULT_CLASSES)
        self.local = torch.nn.Linear(hidden_size, 2)
        self.operator = torch.nn.Linear(hidden_size, len(OPERATORS))
        # made last and only when trained, so runs without it draw the same random numbers as before
        self.operand = torch.nn.Linear(hidden_size, OPERAND_CLASSES) if operand else None
        self.result_layer, self.local_layer, self.operator_layer = result_layer, local_layer, operator_layer


def add_training_heads(model, result_layer: int, local_layer: int, operator_layer: int | None = None,
                       operand: bool = False) -> None:
    model.training_heads = TrainingHeads(model.config.hidden_size, result_layer, local_layer,
                                         result_layer if operator_layer is None else operator_layer, operand)


def drop_training_heads(model) -> None:
    del model.training_heads


def prm_loss(model, ids, targets, lm_labels, token_targets, result_targets, local_targets, operator_targets,
             operand_targets, mask,
             good_id: int, bad_id: int, weights: PRMLossWeights) -> torch.Tensor:
    """Two-way cross-entropy between the `+` and `-` logits at the verdict positions; optionally
    at every token from the first step on (see `prm_example`); the language-model loss on the
    text before the first wrong step; and the training heads' losses. A verdict from binary labels
    alone is an exact-match test nothing leads gradient descent to (a 4-layer model stayed at
    chance on one modulo-100 step after 1,500 batches); with the result computed below it (the
    result head), optionally the question's operator and operand for the step (the operator and
    operand heads), and the
    step's own check made above them (the local head), the top layers only compare and carry an
    earlier error forward."""
    heads = getattr(model, "training_heads", None)
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=heads is not None)
    loss = _two_way_loss(out.logits, targets, good_id, bad_id, weights.bad)
    if weights.token_verdicts:
        loss = loss + weights.token_verdicts * _two_way_loss(out.logits, token_targets, good_id, bad_id, weights.bad)
    if heads is not None:
        loss = loss + weights.result * _head_loss(heads.result, out.hidden_states[heads.result_layer], result_targets)
        loss = loss + weights.local * _head_loss(heads.local, out.hidden_states[heads.local_layer], local_targets)
        if weights.operator:
            loss = loss + weights.operator * _head_loss(heads.operator, out.hidden_states[heads.operator_layer],
                                                        operator_targets)
        if weights.operand and heads.operand is not None:
            loss = loss + weights.operand * _head_loss(heads.operand, out.hidden_states[heads.operator_layer],
                                                       operand_targets)
    if weights.lm and (lm_labels[:, 1:] != IGNORE).any():  # no good step in the batch: nothing to imitate
        loss = loss + weights.lm * _next_token_loss(out.logits, lm_labels)
    return loss


def _head_loss(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    where = targets != IGNORE
    if not where.any():
        return hidden.new_zeros(())
    return torch.nn.functional.cross_entropy(head(hidden[where].float()), targets[where])


def _two_way_loss(logits: torch.Tensor, targets: torch.Tensor, good_id: int, bad_id: int,
                  bad_weight: float = 1.0) -> torch.Tensor:
    where = targets != IGNORE
    weight = torch.tensor([bad_weight, 1.0], dtype=logits.dtype, device=logits.device)
    return torch.nn.functional.cross_entropy(logits[where][:, [bad_id, good_id]], targets[where], weight=weight)


def train(model, next_batch, loss_fn, schedule: Schedule, log_every: int = 50, log=print,
          after_step=None, autocast: torch.dtype | None = None) -> list[float]:
    """AdamW with warm-up and cosine decay; `next_batch(step)` gives the collated tensors;
    `after_step(step, model)`, if given, runs after each optimiser step (checkpoints);
    `autocast` (e.g. torch.bfloat16) runs the forward pass in that dtype, weights staying float32."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": schedule.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=schedule.lr, betas=(0.9, 0.98))
    model.train()
    losses, start = [], time.perf_counter()
    for step in range(schedule.steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = loss_fn(model, *next_batch(step))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == schedule.steps:
            recent = sum(losses[-log_every:]) / len(losses[-log_every:])
            log(f"step {step + 1}/{schedule.steps} loss {recent:.4f} lr {schedule.lr_at(step):.2e} "
                f"{time.perf_counter() - start:.0f}s")
        if after_step is not None:
            model.eval()
            after_step(step + 1, model)
            model.train()
    model.eval()
    return losses


def save(model, tokenizer, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
