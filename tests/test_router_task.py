"""The tool router's training data (tasks/router.py) and the shared-prefix batches it trains on."""
import json
import random

import pytest
import torch

from treeserve.tasks.router import CHAT_TEMPLATE, PIECES, SPECIAL_TOKENS, router_example
from treeserve.tasks.tokenizer import train_bpe_tokenizer
from treeserve.tasks.training import IGNORE, collate, lm_loss, shared_prefix_loss, split_shared_prefix

TOOLS = ("weather", "wikipedia")


def _examples(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [router_example(rng, TOOLS) for _ in range(n)]


def test_calls_copy_the_expression_of_the_message_in_the_grammars_compact_json():
    for example in _examples(400):
        call = json.loads(example.target.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        assert call == {"name": example.name, "arguments": example.arguments}
        assert json.dumps(call, separators=(",", ":")) in example.target  # no spaces the grammar would refuse
        if "expression" in example.arguments:
            assert example.arguments["expression"] in example.question


def test_an_expression_is_the_same_tokens_in_the_message_and_in_the_call():
    examples = _examples(1500)
    tokenizer = train_bpe_tokenizer([e.question + "\n" + e.target for e in examples], 800, SPECIAL_TOKENS,
                                    "<|im_end|>", CHAT_TEMPLATE, pieces=PIECES)

    def pieces(text: str) -> list[str]:
        return [tokenizer.decode([i]) for i in tokenizer.encode(text, add_special_tokens=False)]

    def contains(tokens: list[str], part: list[str]) -> bool:
        return any(tokens[i:i + len(part)] == part for i in range(len(tokens) - len(part) + 1))

    checked = 0
    for example in _examples(300, seed=1):
        if "expression" not in example.arguments:
            continue
        expression = pieces(example.arguments["expression"])
        assert contains(pieces(example.question), expression), example
        assert contains(pieces(example.target), expression), example
        checked += 1
    assert checked > 150
    # an operator keeps its spaces: no bare space token inside a spaced expression
    assert pieces("17 * 23 + 5") == ["1", "7", " * ", "2", "3", " + ", "5"]
    assert "".join(pieces("What is 17 * 23 + 5?")) == "What is 17 * 23 + 5?"


@pytest.fixture
def tiny_model():
    import transformers

    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                                      pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_a_shared_prefix_batch_gives_the_loss_and_gradients_of_the_whole_rows(tiny_model):
    rng = random.Random(0)
    system = [rng.randrange(1, 50) for _ in range(20)]
    rows = []
    for _ in range(4):
        question = [rng.randrange(1, 50) for _ in range(rng.randint(2, 6))]
        answer = [rng.randrange(1, 50) for _ in range(rng.randint(2, 6))]
        rows.append((system + question + answer, [IGNORE] * (len(system) + len(question)) + answer))
    prefix, *batch = split_shared_prefix(rows, 0)
    assert prefix.tolist() == system[:len(prefix)] and len(prefix) >= len(system)
    assert all((batch[1][:, 0] == IGNORE).tolist())  # no labelled token went into the prefix
    whole = lm_loss(tiny_model, *collate(rows, 0))
    shared = shared_prefix_loss(tiny_model, prefix, *batch)
    assert shared.item() == pytest.approx(whole.item(), rel=1e-5)
    params = list(tiny_model.parameters())
    for a, b in zip(torch.autograd.grad(whole, params), torch.autograd.grad(shared, params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_prefix_stops_before_the_first_token_the_loss_predicts(tiny_model):
    prompt = [5, 6, 7, 8, 9]
    rows = [(prompt + [10, 11], [IGNORE] * 5 + [10, 11]), (prompt + [12], [IGNORE] * 5 + [12])]
    prefix, ids, labels, mask = split_shared_prefix(rows, 0)
    assert prefix.tolist() == [5, 6, 7, 8]  # token 9's logits predict the first answer token
    assert shared_prefix_loss(tiny_model, prefix, ids, labels, mask).item() == pytest.approx(
        lm_loss(tiny_model, *collate(rows, 0)).item(), rel=1e-5)


def test_rows_with_nothing_in_common_fall_back_to_whole_rows(tiny_model):
    rows = [([1, 2, 3], [IGNORE, 2, 3]), ([4, 5, 6, 7], [IGNORE, IGNORE, 6, 7])]
    prefix, ids, labels, mask = split_shared_prefix(rows, 0)
    assert len(prefix) == 0 and ids.shape == (2, 4)
    assert shared_prefix_loss(tiny_model, prefix, ids, labels, mask).item() == pytest.approx(
        lm_loss(tiny_model, *collate(rows, 0)).item())


def test_a_call_sent_back_renders_as_the_json_the_model_wrote():
    """The server hands a call's arguments to the template as an object (HF templates' way): the
    bundled router's template writes it back as the compact JSON it was trained to write (it printed
    a Python dict, `{'operation': ...}`), for the template shipped with the model and the one here."""
    from pathlib import Path

    from transformers import AutoTokenizer

    import treeserve
    from treeserve.entrypoints.chat_utils import render_chat
    from treeserve.wire.chat_messages import ChatMessage, template_messages

    folder = Path(treeserve.__file__).parent / "models" / "arith-router"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    arguments = {"operation": "evaluate", "expression": "17 * 23 + 5"}
    call = {"id": "call_1", "type": "function", "function": {"name": "sympy", "arguments": json.dumps(arguments)}}
    messages = template_messages([ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "What is 17 * 23 + 5?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "396"}]])
    written = '{"name":"sympy","arguments":{"operation":"evaluate","expression":"17 * 23 + 5"}}'
    assert (folder / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert written in render_chat(tokenizer, messages)
    assert written in render_chat(tokenizer, messages, chat_template=CHAT_TEMPLATE)
