"""A checkpoint's side files, read as vLLM reads them. generation_config.json (`--generation-config
auto|vllm|FOLDER`): its sampling fields are the defaults of requests that leave them out
(max_new_tokens too, served); its eos ids stop in every mode, with the tokenizer's eos. A checkpoint
without a chat template: chats are refused, saying how to give one."""
import json
import shutil

import httpx
import pytest

from conftest import running_server
from treeserve import LLM, SamplingParams
from treeserve.errors import ParamError

GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 5,
              "eos_token_id": [2, 5, 6]}
OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)


@pytest.fixture(scope="module")
def model_dir(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "m"
    shutil.copytree(llama_dir, path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, **GENERATION}))
    return path


def _served(model_dir, **options):
    from treeserve.server.launch import build_app

    return running_server(build_app(str(model_dir), served_model_name="tiny", **OPTIONS, **options))


def _lengths(url: str, **body) -> tuple[int, int]:
    """Completion tokens of a chat and of a completion, greedy, never stopped by EOS."""
    common = {"model": "tiny", "temperature": 0, "ignore_eos": True, **body}
    chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={**common, "messages": [{"role": "user", "content": "hi"}]})
    text = httpx.post(url + "/v1/completions", timeout=120, json={**common, "prompt": "hi"})
    assert chat.status_code == 200 and text.status_code == 200, (chat.text, text.text)
    return chat.json()["usage"]["completion_tokens"], text.json()["usage"]["completion_tokens"]


def test_served_max_new_tokens_bounds_requests_that_leave_max_tokens_out(model_dir):
    """As vLLM: a chat without max_tokens stopped at the model's max_new_tokens (it ran to the context
    length), a completion at the smaller of it and 16; a request's own max_tokens is kept."""
    with _served(model_dir) as url:
        assert _lengths(url) == (5, 5)
        assert _lengths(url, max_tokens=9) == (9, 9)
        chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "temperature": 0, "ignore_eos": True, "max_completion_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}]})
        assert chat.json()["usage"]["completion_tokens"] == 8



def test_served_max_new_tokens_is_cut_to_the_room_left_not_refused(model_dir):
    """The model's max_new_tokens (5) is a default, not the request's own: a chat whose prompt (6
    tokens) leaves 3 in a 9-token context gets 3 (as vLLM), where a request's own max_tokens: 5 is a 400."""
    with _served(model_dir, max_model_len=9) as url:
        body = {"model": "tiny", "temperature": 0, "ignore_eos": True, "messages": [{"role": "user", "content": "hi"}]}
        chat = httpx.post(url + "/v1/chat/completions", timeout=120, json=body)
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"] == {**chat.json()["usage"], "prompt_tokens": 6, "completion_tokens": 3}
        assert chat.json()["choices"][0]["finish_reason"] == "length"
        own = httpx.post(url + "/v1/chat/completions", timeout=120, json={**body, "max_tokens": 5})
        assert own.status_code == 400 and own.json()["error"]["param"] == "max_tokens"

def test_generation_config_vllm_keeps_treeserve_defaults_and_the_stop_ids(model_dir):
    llm = LLM(str(model_dir), generation_config="vllm", **OPTIONS)
    assert llm.get_default_sampling_params() == SamplingParams()
    assert llm.engine.loaded.eos_token_ids == (2, 5, 6)
    auto = LLM(str(model_dir), **OPTIONS).get_default_sampling_params()
    assert (auto.temperature, auto.top_p, auto.top_k, auto.max_tokens) == (0.6, 0.9, 20, 5)


def test_served_generation_config_vllm_leaves_max_tokens_to_the_api(model_dir):
    with _served(model_dir, generation_config="vllm", max_model_len=64) as url:
        chat, text = _lengths(url)
        assert text == 16 and chat > 16  # the chat runs to the context length, as vLLM's


def test_generation_config_from_another_folder(model_dir, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "eos_token_id": 7}))
    llm = LLM(str(model_dir), generation_config=str(tmp_path), **OPTIONS)
    assert llm.get_default_sampling_params().temperature == 0.3
    assert llm.engine.loaded.eos_token_ids == (7, 2)  # with the tokenizer's eos


def test_a_generation_config_folder_without_the_file_is_named(model_dir, tmp_path):
    with pytest.raises(ParamError, match=r"generation_config.*generation_config\.json: file not found"):
        LLM(str(model_dir), generation_config=str(tmp_path), **OPTIONS)
    with pytest.raises(ParamError, match="generation_config"):
        LLM(str(model_dir), generation_config=None, **OPTIONS)


def test_the_cli_passes_generation_config():
    import argparse

    from treeserve.cli import _add_engine_args, _engine_options

    parser = argparse.ArgumentParser()
    _add_engine_args(parser, several_models=True)
    assert _engine_options(parser.parse_args(["--generation-config", "vllm"]))["generation_config"] == "vllm"
    assert _engine_options(parser.parse_args([]))["generation_config"] == "auto"


def test_the_tokenizers_eos_stops_too_where_generation_config_names_another(llama_dir, tmp_path):
    """As vLLM (the tokenizer's eos plus the generation config's): a fine-tune whose tokenizer ends
    turns with <|eos|> (2) while its generation_config.json still names its base's (5) stops on 2;
    it ran on to max_tokens."""
    path = tmp_path / "m"
    shutil.copytree(llama_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    llm = LLM(str(path), **OPTIONS)
    assert llm.engine.loaded.eos_token_ids == (5, 2)
    forced = SamplingParams(temperature=0, max_tokens=10, logit_bias={2: 100.0})
    out = llm.generate(["hello"], forced, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([2], "stop")
    ignored = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, logit_bias={2: 100.0},
                                                     ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(ignored.token_ids) == 4


def test_a_checkpoint_without_a_chat_template_says_how_to_give_one(llama_dir, tmp_path):
    """Served, a chat is a 400 (as vLLM's: no default template since transformers 4.44); the message
    names both ways to give one, the offline argument included; completions still work."""
    path = tmp_path / "m"
    shutil.copytree(llama_dir, path)
    (path / "chat_template.jinja").unlink()
    llm = LLM(str(path), **OPTIONS)
    with pytest.raises(ParamError, match="no chat template.*--chat-template FILE served, chat_template= offline"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False,
                    chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")[0].outputs[0].token_ids
    with _served(path) as url:
        chat = httpx.post(url + "/v1/chat/completions", timeout=120,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "chat_template.jinja" in chat.json()["error"]["message"]
        assert chat.json()["error"]["param"] == "messages"
        text = httpx.post(url + "/v1/completions", timeout=120, json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert text.status_code == 200
