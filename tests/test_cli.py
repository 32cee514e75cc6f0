"""The `treeserve run` command on the built-in default model and on a given directory."""
from treeserve import LLM, SamplingParams
from treeserve.cli import main


def test_run_builtin_default(capsys):
    assert main(["run", "--max-tokens", "5", "Hello"]) == 0
    out = capsys.readouterr().out
    assert "prompt: 'Hello'" in out and "5 tokens" in out


def test_run_chat_with_model_dir(llama_dir, capsys):
    assert main(["run", "--model", str(llama_dir), "--chat", "--max-tokens", "4", "-n", "2", "--temperature",
                 "1.0", "--seed", "1", "Hi"]) == 0
    assert capsys.readouterr().out.count("4 tokens") == 2


def test_run_reports_bad_input(capsys):
    assert main(["run", "--max-tokens", "0", "Hello"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_chat_uses_the_template(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory_bytes=4 << 20)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=3), use_tqdm=False)[0]
    text = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert text == "<|bos|><|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"
