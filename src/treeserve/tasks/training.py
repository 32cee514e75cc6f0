"""Plain-PyTorch training of the arithmetic task's generator and process reward model, on CPU.

The generator learns the solutions (loss on the assistant turn only). The PRM is trained on steps
the generator itself sampled, labelled by exact checking, in the RLHFlow format: its verdict at
every assistant turn is a two-way choice between the `+` and `-` tokens, read the way
`treeserve.runtime.prm_recipes.RLHFlowRecipe` reads it at inference.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from treeserve.runtime.prm_recipes import RLHFlowRecipe
from treeserve.tasks.arithmetic import LEVELS, Problem, random_problem, split_of

IGNORE = -100


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int


GENERATOR_SHAPE = ModelShape(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=384)
PRM_EXTRA_LAYERS = 2  # the PRM is the trained generator grown by this many layers, then trained on verdicts


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


def new_model(tokenizer, shape: ModelShape, seed: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
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


def train_problems(rng: random.Random, n: int, levels: tuple[int, ...] = LEVELS) -> list[Problem]:
    """`n` training-split problems, each of a level drawn from `levels` (other splits' problems skipped)."""
    problems = []
    while len(problems) < n:
        problem = random_problem(rng, rng.choice(levels))
        if split_of(problem.text) == "train":
            problems.append(problem)
    return problems


def one_level_batch(rng: random.Random, n: int) -> list[Problem]:
    """`n` training problems of one random level: equal lengths, so no compute is spent on padding."""
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


def prm_example(tokenizer, question: str, steps: list[str], labels: list[bool]) -> tuple[list[int], list[int]]:
    """RLHFlow-format ids (every verdict turn reads `+`, as at inference) and per-position targets:
    1 where the step is good, 0 where it is bad, IGNORE elsewhere."""
    built = RLHFlowRecipe().build(tokenizer, question, steps)
    targets = [IGNORE] * len(built.token_ids)
    for position, good in zip(built.verdict_positions, labels):
        targets[position] = int(good)
    return built.token_ids, targets


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (token_ids, targets) in enumerate(examples):
        ids[row, : len(token_ids)] = torch.tensor(token_ids)
        labels[row, : len(targets)] = torch.tensor(targets)
        mask[row, : len(token_ids)] = 1
    return ids, labels, mask


def lm_loss(model, ids, labels, mask) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=IGNORE)


def verdict_loss(model, ids, targets, mask, good_id: int, bad_id: int) -> torch.Tensor:
    """Two-way cross-entropy between the `+` and `-` logits at the verdict positions."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    where = targets != IGNORE
    verdict_logits = model.lm_head(hidden[where])[:, [bad_id, good_id]]
    return torch.nn.functional.cross_entropy(verdict_logits, targets[where])


def train(model, next_batch, loss_fn, schedule: Schedule, log_every: int = 50, log=print) -> list[float]:
    """AdamW with warm-up and cosine decay; `next_batch(step)` gives the collated tensors."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": schedule.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=schedule.lr, betas=(0.9, 0.98))
    model.train()
    losses, start = [], time.perf_counter()
    for step in range(schedule.steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
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
    model.eval()
    return losses


def save(model, tokenizer, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
