"""The heads of process reward models that are not language models: what they compute per token in
place of next-token logits. Parameter names are the checkpoints' own, so weights load by name.

- `classify` (`Qwen2ForProcessRewardModel`, Qwen2.5-Math-PRM): `score` = Linear(hidden, hidden),
  ReLU, Linear(hidden, num_labels); a step's score is the softmax's positive class (label 1) at
  the step separator.
- `value` (`Qwen2ForPrmModel`, Skywork's PRMs): `v_head.summary` = Linear(hidden, 1); a step's
  score is the sigmoid of that value at the step's last token.
"""
from __future__ import annotations

from torch import nn

from treeserve.model.hf_config import ModelConfig


class ValueHead(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.summary = nn.Linear(hidden, 1)

    def forward(self, hidden):
        return self.summary(hidden)


def make_head(config: ModelConfig) -> tuple[str, nn.Module] | None:
    """(attribute name, module) of the model's head, None for a language model (its lm_head)."""
    if config.head == "classify":
        hidden = config.hidden_size
        return "score", nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, config.num_labels))
    if config.head == "value":
        return "v_head", ValueHead(config.hidden_size)
    return None
