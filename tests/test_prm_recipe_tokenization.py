"""PRM recipes on a tokenizer that splits a prefix unlike the whole text: a GPT-2-style byte-level
BPE with a merge that makes "\n\n" one token. Its pre-tokenizer keeps "\n\n" whole at the end of a
text but splits "\n\n+" as "\n", "\n", "+", so locating verdicts by tokenizing prefixes apart
fails there; the recipes locate them in the one tokenization of the full text."""
import pytest
import torch
import transformers

from treeserve import Runtime
from treeserve.runtime.prm_recipes import RECIPES
from treeserve.search.reference import HFStepScorer
from treeserve.testing.tiny_models import make_tiny_model

QUESTION = "What is 2 + 3, times 4?"
STEPS = ["Step 1: 2 + 3 = 5.", "Step 2: 5 * 4 = 20.", "Step 3: so the answer is boxed 20.",
         "Step 4: check: 20 / 4 = 5."]
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|pad|>"]
# Llama 3's turn layout, which RLHFlow's PRMs use: every turn's content follows "\n\n"
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
STEP_TAG = "ки"
# byte-level symbols: "Ċ" is "\n", "Ġ" is " ", "Ðº" and "Ð¸" are the UTF-8 bytes of "к" and "и"
NEWLINES, TAG_BYTES = [("Ċ", "Ċ")], [("Ð", "º"), ("Ð", "¸"), ("Ðº", "Ð¸")]


def newline_merging_tokenizer(extra_merges=(), chat_template=LLAMA3_CHAT_TEMPLATE):
    """Byte-level BPE from a constructed vocabulary: every byte, "\n\n" and the step tag `ки`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    merges = NEWLINES + TAG_BYTES + list(extra_merges)
    symbols = SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in merges]
    tokenizer = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split pattern
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|pad|>",
        clean_up_tokenization_spaces=False)
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def tokenizer():
    return newline_merging_tokenizer()


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory, tokenizer):
    return make_tiny_model("llama", tmp_path_factory.mktemp("newline-merging-prm"), seed=3, tokenizer=tokenizer)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _chat_text(tokenizer, conversation, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)


def _conversation(verdict: str) -> list[dict]:
    turns = []
    for index, step in enumerate(STEPS):
        turns += [{"role": "user", "content": f"{QUESTION} {step}" if index == 0 else step},
                  {"role": "assistant", "content": verdict}]
    return turns


def test_the_tokenizer_splits_a_prefix_unlike_the_whole(tokenizer):
    assert tokenizer.convert_ids_to_tokens(_ids(tokenizer, "\n\n")) == ["ĊĊ"]
    assert tokenizer.convert_ids_to_tokens(_ids(tokenizer, "\n\n+")) == ["Ċ", "Ċ", "+"]
    # The old RLHFlow way: the conversation up to the first verdict turn, tokenized apart, was to
    # be a prefix of the whole with `+` right after it; here it ends in "\n\n", one token.
    full = _ids(tokenizer, _chat_text(tokenizer, _conversation("+")))
    prefix = _ids(tokenizer, _chat_text(tokenizer, _conversation("+")[:1], add_generation_prompt=True))
    assert full[: len(prefix)] != prefix
    assert full[len(prefix)] != tokenizer.convert_tokens_to_ids("+")
    # the chat-steps way: the solution through step 1 apart, against the whole
    solution = "\n\n".join(STEPS) + "\n\n"
    through_first = _ids(tokenizer, solution[: len(STEPS[0]) + 2])
    assert _ids(tokenizer, solution)[: len(through_first)] != through_first


def _sal_rlhflow_input(tokenizer) -> tuple[list[int], list[int]]:
    """Search-and-Learn's RLHFlow reading: render the conversation again with `ки` for every `+`,
    and read each step where the next token of that twin is `ки`."""
    ids = _ids(tokenizer, _chat_text(tokenizer, _conversation("+")))
    twin = _ids(tokenizer, _chat_text(tokenizer, _conversation(STEP_TAG)))
    tag = _single_id(tokenizer, STEP_TAG)
    assert len(twin) == len(ids)
    return ids, [i for i in range(len(twin) - 1) if twin[i + 1] == tag]


def _sal_math_shepherd_input(tokenizer) -> tuple[list[int], list[int]]:
    """Math-Shepherd's reading (as Search-and-Learn does it): each step where the token is the tag."""
    ids = tokenizer.encode(f"{QUESTION} " + "\n".join(f"{step} {STEP_TAG}" for step in STEPS))
    tag = _single_id(tokenizer, STEP_TAG)
    return ids, [i for i, token in enumerate(ids) if token == tag]


def _single_id(tokenizer, text: str) -> int:
    (token,) = _ids(tokenizer, text)
    return token


@pytest.mark.parametrize("recipe, sal_input", [("rlhflow", _sal_rlhflow_input),
                                               ("math-shepherd", _sal_math_shepherd_input)])
def test_engine_scores_match_hf_over_the_full_text(prm_dir, tokenizer, recipe, sal_input):
    ids, positions = sal_input(tokenizer)
    assert len(positions) == len(STEPS)
    built = RECIPES[recipe].build(tokenizer, QUESTION, STEPS)
    assert (built.token_ids, built.verdict_positions) == (ids, positions)
    hf = transformers.AutoModelForCausalLM.from_pretrained(prm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    good, bad = _single_id(tokenizer, "+"), _single_id(tokenizer, "-")
    reference = [float(torch.softmax(logits[p, [good, bad]], dim=-1)[0]) for p in positions]

    options = dict(recipes={"prm": recipe}, dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    rt = Runtime({"prm": str(prm_dir)}, **options)
    ours = rt.score_steps("prm", QUESTION, STEPS)
    rt.close()
    print(f"{recipe}: max |treeserve - HF| = {max(abs(a - b) for a, b in zip(ours, reference)):.2e}")
    assert ours == pytest.approx(reference, abs=1e-4)
    # step by step, each scoring forks the kept KV of the one before: the texts must extend each other
    rt = Runtime({"prm": str(prm_dir)}, **options)
    stepwise = [rt.score_steps("prm", QUESTION, STEPS[:k])[-1] for k in range(1, len(STEPS) + 1)]
    rt.close()
    assert stepwise == pytest.approx(reference, abs=1e-4)
    # the Search-and-Learn reference mode's verifier reads the same positions
    hf_scorer = HFStepScorer(str(prm_dir), tokenizer, recipe)
    assert hf_scorer.score_many([(QUESTION, STEPS)])[0] == pytest.approx(reference, abs=1e-4)


def test_chat_steps_does_not_apply_and_says_why(tokenizer):
    """chat-steps reads step k at the last token of the "\n\n" after it. Here that delimiter is
    one token after the last step but two ("\n", "\n") before another step, so a step would be
    read at another token once a step follows it: the recipe refuses rather than score."""
    with pytest.raises(ValueError, match=r"prm recipe chat-steps: the step delimiter .* does not tokenize the same"):
        RECIPES["chat-steps"].build(tokenizer, QUESTION, STEPS)


@pytest.mark.parametrize("template_turn, merge, problem", [
    ("{{ m['content'] }}.", ("+", "."), "shares its last token with the text after it, .*'\\+\\.'"),
    (":{{ m['content'] }}", (":", "+"), "is not a token of its own .*':\\+'"),
])
def test_a_verdict_merged_with_neighbouring_text_is_refused(template_turn, merge, problem):
    template = "{% for m in messages %}" + template_turn + "<|eot_id|>{% endfor %}"
    merging = newline_merging_tokenizer([merge], template)
    with pytest.raises(ValueError, match="prm recipe rlhflow: the verdict '\\+' " + problem):
        RECIPES["rlhflow"].build(merging, QUESTION, STEPS)


def test_a_step_tag_may_share_its_token_with_the_space_before_it():
    """As Mistral's tokenizer (Math-Shepherd's) makes " ки" one token: the verdict is read there."""
    merging = newline_merging_tokenizer([("Ġ", "ÐºÐ¸")])
    built = RECIPES["math-shepherd"].build(merging, QUESTION, STEPS)
    assert merging.convert_ids_to_tokens([built.token_ids[p] for p in built.verdict_positions]) == ["ĠÐºÐ¸"] * 4
