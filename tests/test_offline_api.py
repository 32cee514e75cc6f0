"""The offline API as a vLLM user drives it (a helper's audit): SamplingParams changed after they
were made, logprobs past the vocabulary, LLM.chat's continue_final_message and template variables,
a rendered chat's prompt in its output, and clear errors for what vLLM users pass by habit."""
import asyncio

import pytest

from conftest import assert_no_leak
from treeserve import LLM, SamplingParams
from treeserve.engine.async_engine import AsyncLLMEngine
from treeserve.errors import ParamError

OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=256)
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last or add_generation_prompt %}"
            "</{{ m.role }}>{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
            "{% if flavour %}[{{ flavour }}]{% endif %}")


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), trust_remote_code=True, **OPTIONS)  # (vLLM's habit: taken, no effect)


def test_sampling_params_changed_after_they_were_made_are_honoured(llm):
    """vLLM's own example changes get_default_sampling_params()'s result; a stop set that way was
    ignored at n=1 (derived once, at construction) and honoured at n=2."""
    prompt = {"prompt_token_ids": [1, 5, 9, 14]}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    stop = free[3:5]
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    changed = llm.get_default_sampling_params()
    changed.temperature, changed.max_tokens, changed.stop = 0, 24, [stop]
    got = llm.generate(prompt, changed, use_tqdm=False)[0]
    assert got.outputs[0].text == expected.outputs[0].text and got.outputs[0].stop_reason == stop
    changed.max_tokens = 0
    with pytest.raises(ParamError, match="max_tokens"):
        llm.generate(prompt, changed, use_tqdm=False)
    changed.max_tokens, changed.stop_token_ids = 4, None
    assert len(llm.generate(prompt, changed, use_tqdm=False)[0].outputs[0].token_ids) <= 4


def test_logprobs_past_the_vocabulary_are_a_param_error_not_a_failed_step(llm):
    size = llm.engine.model_config.vocab_size  # (a top-k past it was a RuntimeError in the sampler)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ParamError, match=name):
            llm.generate("Hello", SamplingParams(max_tokens=2, **{name: size + 1}), use_tqdm=False)
    assert llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)[0].outputs[0].logprobs
    assert_no_leak(llm.engine)


def test_minus_one_logprobs_are_the_whole_vocabulary_as_vllms(llm):
    """vLLM's `logprobs=-1` / `prompt_logprobs=-1` (every token's logprob) were a ParamError."""
    size = llm.engine.model_config.vocab_size
    prompt = {"prompt_token_ids": [1, 5, 9, 14]}
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=-1, prompt_logprobs=-1),
                       use_tqdm=False)[0]
    own = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=0, prompt_logprobs=0),
                       use_tqdm=False)[0]
    sample = out.outputs[0]
    assert sample.token_ids == own.outputs[0].token_ids
    assert [len(entry) for entry in sample.logprobs] == [size] * 3
    assert [len(entry) for entry in out.prompt_logprobs[1:]] == [size] * 3 and out.prompt_logprobs[0] is None
    for entry, token, alone in zip(sample.logprobs, sample.token_ids, own.outputs[0].logprobs):
        assert entry[token].rank == 1 and abs(entry[token].logprob - alone[token].logprob) < 1e-5
        assert sorted(lp.rank for lp in entry.values()) == list(range(1, size + 1))
    assert_no_leak(llm.engine)


def test_vllms_max_logprobs_is_taken_and_caps_the_counts(llama_dir):
    """vLLM takes `logprobs=-1` only from an LLM made with `max_logprobs=-1` (its cap, 20 by default);
    that argument was a ParamError ("not an engine option here"), so a ported script asking for the
    whole vocabulary could not start. A cap given is honoured as vLLM's: a count past it, -1 included,
    is a ParamError naming the count."""
    prompt = {"prompt_token_ids": [1, 5, 9, 14]}
    whole = LLM(str(llama_dir), max_logprobs=-1, **OPTIONS)
    size = whole.engine.model_config.vocab_size
    out = whole.generate(prompt, SamplingParams(max_tokens=2, logprobs=-1), use_tqdm=False)[0]
    assert [len(entry) for entry in out.outputs[0].logprobs] == [size] * 2
    capped = LLM(str(llama_dir), max_logprobs=3, **OPTIONS)
    got = capped.generate(prompt, SamplingParams(max_tokens=2, logprobs=3, prompt_logprobs=3), use_tqdm=False)[0]
    assert all(3 <= len(entry) <= 4 for entry in got.outputs[0].logprobs)
    for name in ("logprobs", "prompt_logprobs"):
        for count in (4, -1):
            with pytest.raises(ParamError, match=f"^{name}: .*max_logprobs") as error:
                capped.generate(prompt, SamplingParams(max_tokens=2, **{name: count}), use_tqdm=False)
            assert error.value.param == name
    assert_no_leak(capped.engine)
    for bad in (-2, "20", True):
        with pytest.raises(ParamError, match="^max_logprobs: "):
            LLM(str(llama_dir), max_logprobs=bad, **OPTIONS)


def test_chat_names_a_missing_conversation_or_role(llm):
    """`chat([])` named `prompts` (generate's argument), tools not given as a list were the chat
    template's failure, and a message without a role was rendered with an empty one ("<||>hi")
    where vLLM's LLM.chat fails on it."""
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ParamError, match="^messages:") as error:
        llm.chat([], params, use_tqdm=False)
    assert error.value.param == "messages"
    for tools in ({"type": "function"}, "calculator", [1]):  # (the template's failure, named `messages`, before)
        with pytest.raises(ParamError, match="^tools:"):
            llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False, tools=tools)
    for conversation in ([{"content": "hi"}], [[{"role": "user", "content": "hi"}], [{"role": None, "content": "x"}]]):
        with pytest.raises(ParamError, match=r"messages\[0\]\.role") as error:
            llm.chat(conversation, params, use_tqdm=False, chat_template=TEMPLATE)
    assert_no_leak(llm.engine)


def test_reset_prefix_cache_as_vllms(llm):
    """vLLM's `LLM.reset_prefix_cache()` was an AttributeError (only `Runtime` had one)."""
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(max_tokens=1)
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0


def test_engine_arguments_name_themselves_when_wrong(llama_dir, tmp_path):
    """vLLM's `seed=None` (its V1 engine's 0, up to 0.12) was a TypeError from int() at load, and a
    missing `tokenizer` folder was reported as the `model`."""
    assert LLM(str(llama_dir), seed=None, **OPTIONS).engine.loaded.config.seed == 0
    with pytest.raises(FileNotFoundError, match="^tokenizer: .*nowhere"):
        LLM(str(llama_dir), tokenizer=str(tmp_path / "nowhere"), **OPTIONS)
    with pytest.raises(ParamError, match="^tokenizer: unknown built-in") as error:
        LLM(str(llama_dir), tokenizer="builtin:nowhere", **OPTIONS)
    assert error.value.param == "tokenizer"


def test_the_engine_names_a_prompt_given_where_it_takes_token_ids(llm):
    """vLLM's `llm_engine.add_request(id, "Hello", params)` read the text's characters as token ids
    ("prompt: token id 'H' is outside the vocabulary"); a dict's keys likewise."""
    engine = llm.llm_engine
    for prompt in ("Hello", {"prompt_token_ids": [1, 5, 9]}):
        with pytest.raises(ParamError, match="^prompt_token_ids: expected a list of token ids") as error:
            engine.add_request("vllm-habit", prompt, SamplingParams(max_tokens=2))
        assert error.value.param == "prompt_token_ids"
    with pytest.raises(ParamError, match="^prompt_token_ids: expected a list of token ids"):
        engine.validate_prompt("Hello")  # (AsyncLLMEngine.generate's check)
    engine.add_request("vllm-habit", [1, 5, 9], SamplingParams(max_tokens=2))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 2
    assert_no_leak(engine)


def test_the_async_engine_names_a_prompt_given_where_it_takes_token_ids_under_truncation(llm):
    """With `truncate_prompt_tokens`, AsyncLLMEngine.generate cut the prompt before its check: a
    text's last characters were read as token ids ("token id 'l' is outside the vocabulary") and a
    dict's slice was a TypeError."""
    served = AsyncLLMEngine(llm.engine, start_thread=False)
    params = SamplingParams(max_tokens=2, truncate_prompt_tokens=3)
    for prompt in ("Hello", {"prompt_token_ids": [1, 5, 9]}):
        with pytest.raises(ParamError, match="^prompt_token_ids: expected a list of token ids"):
            asyncio.run(anext(served.generate(prompt, params, "vllm-habit")))
    assert_no_leak(llm.engine)


def test_vllms_prompt_dicts_are_importable_and_taken(llm):
    """`from vllm import TokensPrompt, TextPrompt` ported as `from treeserve import ...` was an
    ImportError; they are vLLM's TypedDicts (plain dicts), taken as the dicts they are."""
    from treeserve import TextPrompt, TokensPrompt
    from treeserve.inputs import PromptType  # noqa: F401  (vllm.inputs' other name)

    params = SamplingParams(temperature=0, max_tokens=3)
    by_ids = llm.generate(TokensPrompt(prompt_token_ids=[1, 5, 9]), params, use_tqdm=False)[0]
    assert by_ids.outputs[0].token_ids == llm.generate([1, 5, 9], params, use_tqdm=False)[0].outputs[0].token_ids
    by_text = llm.generate([TextPrompt(prompt="Hello", cache_salt="a")], params, use_tqdm=False)[0]
    assert by_text.prompt == "Hello" and by_text.prompt_token_ids == llm.get_tokenizer().encode("Hello")


def test_chat_continues_a_prefill_passes_template_variables_and_shows_its_prompt(llm):
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well"}]
    params = SamplingParams(temperature=0, max_tokens=3)
    continued = llm.chat(conversation, params, use_tqdm=False, chat_template=TEMPLATE, add_generation_prompt=False,
                         continue_final_message=True)[0]
    assert continued.prompt == "<user>Hi</user><assistant>Well"
    flavoured = llm.chat(conversation[:1], params, use_tqdm=False, chat_template=TEMPLATE,
                         chat_template_kwargs={"flavour": "mint"})[0]
    assert flavoured.prompt == "<user>Hi</user><assistant>[mint]"
    assert flavoured.prompt_token_ids == llm.get_tokenizer().encode(flavoured.prompt, add_special_tokens=False)
    with pytest.raises(ParamError, match="continue_final_message"):
        llm.chat(conversation, params, use_tqdm=False, chat_template=TEMPLATE, continue_final_message=True)


def test_what_vllm_users_pass_by_habit_is_named(llm, llama_dir):
    for option in ({"max_model_len": "128"}, {"kv_cache_memory_bytes": 1.5e6}, {"gpu_memory_utilization": "0.5"},
                   {"cpu_kv_memory_fraction": "0.5"}, {"cpu_kv_memory_fraction": 0}, {"cpu_kv_memory_fraction": 2.0}):
        with pytest.raises(ParamError, match=next(iter(option))):  # (a comparison's TypeError before)
            LLM(str(llama_dir), **(OPTIONS | option))
    with pytest.raises(ParamError, match="sampling_params"):
        llm.generate("Hi", {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ParamError, match="temperature"):
        SamplingParams(temperature=float("inf"))


TOOL_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
                 "[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}{% endfor %}<assistant>")


def test_chat_reads_messages_as_openai_writes_them(llm):
    """Content given as parts (OpenAI's client, vLLM's LLM.chat) was rendered as a Python list's repr
    ("<user>[{'type': 'text', ...}]"), and an assistant's tool-call arguments (JSON text, as OpenAI
    writes them) were encoded a second time by the template: now the parts' texts joined by newlines
    (vLLM's) and the arguments as the object HF templates expect, the caller's messages untouched."""
    params = SamplingParams(temperature=0, max_tokens=2)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    as_text = [{"role": "user", "content": "Hi\nthere"}]
    got, expected = (llm.chat(c, params, use_tqdm=False, chat_template=TEMPLATE)[0] for c in (parts, as_text))
    assert got.prompt == expected.prompt == "<user>Hi\nthere</user><assistant>"
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert isinstance(parts[0]["content"], list)
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    conversation = [{"role": "user", "content": "Add"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    rendered = llm.chat(conversation, params, use_tqdm=False, chat_template=TOOL_TEMPLATE)[0].prompt
    assert rendered == '<user>Add<assistant>[add {"a": 1}]<assistant>' and call["function"]["arguments"] == '{"a": 1}'
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]
    with pytest.raises(ParamError, match=r"messages\[0\]\.content\[0\]"):
        llm.chat(image, params, use_tqdm=False, chat_template=TEMPLATE)
    bad_call = {**call, "function": {"name": "add", "arguments": "{not json"}}
    with pytest.raises(ParamError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        llm.chat([conversation[0], {**conversation[1], "tool_calls": [bad_call]}], params, use_tqdm=False,
                 chat_template=TOOL_TEMPLATE)
    assert_no_leak(llm.engine)


def test_the_server_joins_content_parts_as_the_offline_api_does():
    from treeserve.wire.chat_messages import ChatMessage  # ("" before: "Hi" + "there" was "Hithere")
    message = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                      {"type": "text", "text": "there"}]})
    assert message.as_template_message()["content"] == "Hi\nthere"


def test_prompt_fields_that_would_change_the_answer_are_named_not_dropped(llm):
    """vLLM's TextPrompt / TokensPrompt fields treeserve cannot use (an image, embeddings) were
    dropped, and the prompt answered without them."""
    params = SamplingParams(temperature=0, max_tokens=2)
    for field, value in (("multi_modal_data", {"image": object()}), ("prompt_embeds", [[0.0, 1.0]]),
                         ("mm_processor_kwargs", {"num_crops": 4})):
        with pytest.raises(ParamError, match=field):
            llm.generate({"prompt": "Hello", field: value}, params, use_tqdm=False)
    plain = llm.generate({"prompt_token_ids": [1, 5, 9]}, params, use_tqdm=False)[0]
    empty = llm.generate({"prompt_token_ids": [1, 5, 9], "multi_modal_data": None, "mm_processor_kwargs": {}},
                         params, use_tqdm=False)[0]  # (fields that say nothing are taken)
    assert empty.outputs[0].token_ids == plain.outputs[0].token_ids
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("name", ["embed", "encode", "classify", "reward", "score"])
def test_vllms_pooling_calls_say_what_to_use_instead(llm, name):
    with pytest.raises(AttributeError, match="Runtime.score_steps"):  # (a bare "no attribute" before)
        getattr(llm, name)
    assert not hasattr(llm, name)
    with pytest.raises(AttributeError, match="'LLM' object has no attribute 'embedd'"):
        llm.embedd


def test_responses_and_messages_join_text_parts_as_a_chat_message_does():
    """(joined with nothing before: "Hi" + "there" was "Hithere", where a chat message and vLLM's
    Responses and Messages endpoints join by newlines)"""
    from treeserve.wire.messages import chat_messages
    from treeserve.wire.responses import input_messages

    parts = [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "there"}]
    assert input_messages([{"role": "user", "content": parts}])[-1]["content"] == "Hi\nthere"
    blocks = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    turns = chat_messages(None, [{"role": "user", "content": blocks}, {"role": "assistant", "content": blocks},
                                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                               "content": blocks}]}])
    assert [turn["content"] for turn in turns] == ["Hi\nthere", "Hi\nthere", "Hi\nthere"]


def test_developer_messages_reach_the_template_as_system_ones_as_on_the_server(llm):
    """OpenAI's `developer` role went to the template as it was offline (an open model's template
    knows `system`), where the server renders it as `system`: one mapping for both now."""
    from treeserve.wire.chat_messages import ChatMessage

    params = SamplingParams(temperature=0, max_tokens=2)
    conversation = [{"role": "developer", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    as_system = [{"role": "system", "content": "Be brief"}, conversation[1]]
    got, expected = (llm.chat(c, params, use_tqdm=False, chat_template=TEMPLATE)[0] for c in (conversation, as_system))
    assert got.prompt == expected.prompt == "<system>Be brief</system><user>Hi</user><assistant>"
    assert conversation[0]["role"] == "developer"  # (the caller's message untouched)
    served = [ChatMessage.model_validate(m).as_template_message() for m in conversation]
    assert [m["role"] for m in served] == ["system", "user"]
    assert llm.apply_chat_template(conversation, chat_template=TEMPLATE) == \
        llm.apply_chat_template(as_system, chat_template=TEMPLATE)


class RecordingBar:
    """A tqdm-like class, as vLLM's `use_tqdm` takes one (a class or a functools.partial)."""
    made: list["RecordingBar"] = []

    def __init__(self, total=None, desc=None, **kwargs):
        self.total, self.desc, self.kwargs, self.done, self.closed = total, desc, kwargs, 0, False
        RecordingBar.made.append(self)

    def update(self, n=1):
        self.done += n

    def close(self):
        self.closed = True


def test_use_tqdm_takes_a_callable_that_makes_the_bar_as_vllms_does(llm):
    """(before: any callable was taken for True, and tqdm's own bar drawn instead of the caller's)"""
    import functools

    params = SamplingParams(temperature=0, max_tokens=2)
    RecordingBar.made.clear()
    outputs = llm.generate(["Hello", "Hi there", "Hey"], params, use_tqdm=RecordingBar)
    assert len(outputs) == 3
    bar, = RecordingBar.made
    assert (bar.total, bar.desc, bar.done, bar.closed) == (3, "Processed prompts", 3, True)
    llm.chat([[{"role": "user", "content": "Hi"}]] * 2, params, chat_template=TEMPLATE,
             use_tqdm=functools.partial(RecordingBar, leave=False))
    assert RecordingBar.made[-1].done == 2 and RecordingBar.made[-1].kwargs["leave"] is False
    assert_no_leak(llm.engine)


def test_vllm_engine_arguments_that_change_nothing_here_are_taken_the_rest_named(llama_dir):
    """vLLM's examples pass `disable_log_stats`, `enable_chunked_prefill`, `swap_space`, ...: each was
    a TypeError from EngineConfig's constructor. Those meaning what treeserve does anyway are taken; a
    value it would not honour, or an unknown name, is a ParamError naming it."""
    habits = dict(disable_log_stats=True, enable_chunked_prefill=True, swap_space=4, tokenizer_mode="auto",
                  revision=None, enable_lora=False, kv_cache_dtype="auto")
    llm = LLM(str(llama_dir), **OPTIONS, **habits)
    assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    for name, value in (("enable_chunked_prefill", False), ("tokenizer_mode", "mistral"), ("revision", "v2"),
                        ("enable_lora", True), ("max_num_seq", 8), ("kv_cache_dtype", "fp8")):
        with pytest.raises(ParamError, match=f"^{name}: "):
            LLM(str(llama_dir), **OPTIONS, **{name: value})


def test_generate_takes_vllms_priority_and_a_none_lora_request(llama_dir):
    """(`priority=` and `lora_request=None`, vLLM's LLM.generate arguments, were TypeErrors)"""
    llm = LLM(str(llama_dir), **(OPTIONS | {"max_num_seqs": 1}))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 5, 9 + i]} for i in range(3)]
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1], lora_request=None)
    order = sorted(range(3), key=lambda i: outputs[i].metrics.first_scheduled_time)
    assert order == [1, 2, 0]  # one at a time (max_num_seqs=1): the lowest priority value first, as vLLM
    plain = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    for bad in ([0, 1], "high", [0, 1.5, 2]):
        with pytest.raises(ParamError, match="priority"):
            llm.generate(prompts, params, use_tqdm=False, priority=bad)
    with pytest.raises(ParamError, match="lora_request"):
        llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False, lora_request=object(),
                 chat_template=TEMPLATE)
    assert_no_leak(llm.engine)


def test_the_engine_held_after_its_llm_is_dropped_is_not_closed_under_its_holder(llama_dir, monkeypatch):
    """`engine = llm.llm_engine; del llm`: the engine keeps working (its LLM's finalizer closed it,
    stopping a tensor-parallel engine's workers under the caller); it is closed when it is let go of."""
    import gc

    from treeserve.engine.loaded_model import LoadedModel

    gc.collect()  # (what earlier tests let go of is closed now, not counted below)
    closed = []
    monkeypatch.setattr(LoadedModel, "close", lambda loaded: closed.append(loaded))
    llm = LLM(str(llama_dir), **OPTIONS)
    engine = llm.llm_engine
    loaded = engine.loaded

    def closes() -> int:  # (this engine's only: a collection may close others' too)
        return sum(one is loaded for one in closed)

    del llm
    gc.collect()
    assert closes() == 0
    again = LLM.from_engine(engine)
    assert again.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    del engine, again
    gc.collect()
    assert closes() == 1


def test_an_llm_let_go_of_frees_its_engine_and_model_at_once(llama_dir):
    """`del llm` (vLLM's way of freeing an engine): its engine sat in a reference cycle (the scheduler's
    reclaim callback held the engine) and, with its model and KV pages, waited for the garbage collector;
    the next model loaded measured its memory beside them. It goes with the last reference now."""
    import gc
    import weakref

    gc.disable()  # (no collection may run: the last reference going frees it all)
    try:
        llm = LLM(str(llama_dir), **OPTIONS)
        assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
        engine, model, pages = (weakref.ref(o) for o in (llm.llm_engine, llm.llm_engine.model,
                                                         llm.llm_engine.runner.arena.pages))
        del llm
        assert engine() is None and model() is None and pages() is None, "left for the garbage collector"
    finally:
        gc.enable()
