"""The `treeserve run` command on the built-in default model and on a given directory; the names
bundled models are given and served by."""
from pathlib import Path

import pytest

from treeserve import LLM, SamplingParams
from treeserve.cli import main
from treeserve.model.registry import named_models, resolve_model_path, served_name


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


def test_a_bundled_name_without_its_prefix_is_hinted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--model", "arith-gen", "Hello"]) == 2
    assert "'arith-gen' is not a local directory (nothing is downloaded from a hub); did you mean builtin:arith-gen?" \
        in capsys.readouterr().err
    assert main(["run", "--model", "no-such-model", "Hello"]) == 2 and "did you mean" not in capsys.readouterr().err
    (tmp_path / "arith-gen").mkdir()  # a local directory of that name is what it names
    assert resolve_model_path("arith-gen") == Path("arith-gen")


def test_builtin_models_are_served_under_their_bare_names():
    assert served_name("builtin:arith-router") == "arith-router"
    assert served_name("/models/my-llama") == "/models/my-llama"  # a directory as given, as vLLM
    assert named_models(["builtin:arith-gen", "builtin:arith-prm"]) == {"arith-gen": "builtin:arith-gen",
                                                                       "arith-prm": "builtin:arith-prm"}
    assert named_models(["gen=builtin:arith-gen", "/models/x"]) == {"gen": "builtin:arith-gen",
                                                                     "/models/x": "/models/x"}
    assert named_models(None) == {"arith-gen": "builtin:arith-gen"}
    with pytest.raises(ValueError, match="'arith-gen' is given twice"):
        named_models(["builtin:arith-gen", "arith-gen=builtin:arith-gen"])


@pytest.mark.parametrize("value, missing", [
    ("=builtin:arith-gen", "a name before"), (" =builtin:arith-gen", "a name before"), ("gen=", "a path after")])
def test_a_model_name_or_path_left_empty_is_an_error(value, missing):
    """(`--model =builtin:arith-gen` served the model as '', and `--model 'gen =PATH'` as 'gen ')"""
    with pytest.raises(ValueError, match=f"NAME=PATH needs {missing} '='"):
        named_models([value])
    assert named_models(["gen =builtin:arith-gen"]) == {"gen": "builtin:arith-gen"}


@pytest.mark.parametrize("argv, flag", [
    (["serve", "--port", "99999"], "--port"), (["serve", "--port", "-1"], "--port"),
    (["gateway", "--port", "65536"], "--port"), (["chat", "--serve-port", "-5"], "--serve-port"),
    (["serve", "--max-queue", "0"], "--max-queue"), (["serve", "--max-queue", "-3"], "--max-queue"),
    (["bench", "calibrate", "--port", "99999"], "--port"),  # (the mock server's traceback, then wait_healthy's)
    (["bench", "serve", "--base-url", "127.0.0.1:8000", "--out", "o"], "--base-url"),  # (waited on for 600 s)
    (["worker", "--broker", "127.0.0.1:5672"], "--broker"),  # (retried every 5 s, for ever)
    (["bench", "throughput", "--tensor-parallel-size", "x"], "--tensor-parallel-size"),  # (said after the HF run)
    (["bench", "throughput", "--hf-batch-sizes", "16,0"], "--hf-batch-sizes"),
])
def test_ports_and_the_queue_bound_are_checked_by_the_parser(argv, flag, capsys):
    """(--port 99999 was an OverflowError's traceback; --max-queue 0 answered every request 429)"""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}:" in last and "Traceback" not in last


def _serve_args(*argv: str):
    from treeserve.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("argv", [
    ["--served-model-name", "foo"],  # the bundled pair
    ["--served-model-name", "foo", "--model", "a=builtin:arith-gen", "--model", "b=builtin:arith-prm"],
])
def test_served_model_name_with_several_models_is_an_error(argv):
    from treeserve.server.launch import served_target

    with pytest.raises(ValueError, match="--served-model-name names one model.*--model NAME=PATH"):
        served_target(_serve_args(*argv))


def test_a_model_named_twice_is_an_error():
    """`--model x=PATH --served-model-name foo` served the model as foo, silently dropping x (vLLM has one
    way to name a model, --served-model-name; NAME=PATH is treeserve's other): one name, or the same one twice."""
    from treeserve.server.launch import served_target

    with pytest.raises(ValueError, match="named twice: 'x' by --model x=PATH and 'foo' by --served-model-name"):
        served_target(_serve_args("--model", "x=builtin:arith-prm", "--served-model-name", "foo"))
    assert served_target(_serve_args("--model", "foo=builtin:arith-prm", "--served-model-name", "foo")) == \
        {"foo": "builtin:arith-prm"}


def test_a_positional_model_and_model_together_is_an_error(caplog):
    from treeserve.ports import free_port
    from treeserve.server.launch import served_target

    with pytest.raises(ValueError, match="either as the argument .* or with --model"):
        served_target(_serve_args("builtin:arith-gen", "--model", "x=builtin:arith-prm"))
    assert served_target(_serve_args("builtin:arith-gen", "--served-model-name", "foo")) == "builtin:arith-gen"
    assert served_target(_serve_args("--model", "builtin:arith-prm", "--served-model-name", "foo")) == \
        {"arith-prm": "builtin:arith-prm"}  # (served as foo: a bare path names nothing)
    # the command refuses it before loading anything
    assert main(["serve", "--port", str(free_port()), "builtin:arith-gen", "--model", "builtin:arith-prm"]) == 2
    assert "or with --model, not both" in caplog.text


def test_a_blank_api_key_is_refused_not_an_open_server(caplog):
    """`--api-key "$KEY"` with KEY unset gave an empty key, which was dropped: the server started with
    every route open and said nothing. It is refused before anything loads (exit 2), as is a key no
    client could send (spaces at either end: a presented key is stripped)."""
    from treeserve.ports import free_port
    from treeserve.server.launch import api_keys

    for blank in ("", "  "):
        with pytest.raises(ValueError, match="--api-key: a blank key would leave every route open"):
            api_keys(_serve_args("--api-key", "sk-real", "--api-key", blank))
    with pytest.raises(ValueError, match="cannot start or end with spaces"):
        api_keys(_serve_args("--api-key", " sk-padded"))
    assert api_keys(_serve_args("--api-key", "sk-a", "--api-key", "sk-b")) == ["sk-a", "sk-b"]
    assert main(["serve", "--port", str(free_port()), "builtin:arith-gen", "--api-key", ""]) == 2
    assert "a blank key would leave every route open" in caplog.text


def test_vllm_serve_flags_are_taken():
    args = _serve_args("--enable-prefix-caching", "--uvicorn-log-level", "debug", "--disable-uvicorn-access-log",
                       "--disable-log-requests", "--seed", "7", "--gpu-memory-utilization", "0.5")
    assert args.enable_prefix_caching and args.uvicorn_log_level == "debug" and args.disable_uvicorn_access_log
    assert args.seed == 7 and args.gpu_memory_utilization == 0.5
    assert not _serve_args("--no-enable-prefix-caching").enable_prefix_caching
    assert not _serve_args("--no-prefix-caching").enable_prefix_caching
    assert _serve_args().seed == 0 and _serve_args().uvicorn_log_level == "info"


def test_vllm_logging_flags_are_taken():
    """`--disable-log-stats` is in most vLLM command lines (benchmarks'), `--enable-log-requests` in newer ones:
    both were refused (exit 2)."""
    assert _serve_args("--disable-log-stats").disable_log_stats and not _serve_args().disable_log_stats
    assert _serve_args("--enable-log-requests").enable_log_requests and not _serve_args().enable_log_requests


def test_serve_hands_the_flags_to_the_engines_and_uvicorn(monkeypatch):
    from treeserve.ports import free_port
    from treeserve.server import launch

    built, configs = {}, []
    monkeypatch.setattr(launch, "build_app", lambda target, **options: built.update(options) or _Stop.app())
    monkeypatch.setattr(launch, "warn_replaced_tool_templates", lambda *args: None)
    monkeypatch.setattr(launch, "freeze_startup_heap", lambda: None)
    monkeypatch.setattr(launch, "DrainingServer", lambda config, drain, name: configs.append(config) or _Stop.fail())
    args = _serve_args("--port", str(free_port()), "--seed", "7", "--gpu-memory-utilization", "0.5",
                       "--no-enable-prefix-caching", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log")
    with pytest.raises(_Stop):
        launch.serve(args)
    assert built["seed"] == 7 and built["gpu_memory_utilization"] == 0.5 and built["enable_prefix_caching"] is False
    assert configs[0].log_level == "warning" and configs[0].access_log is False


class _Stop(Exception):
    @staticmethod
    def app():
        from types import SimpleNamespace

        return SimpleNamespace(state=SimpleNamespace(engine=SimpleNamespace(engines={}), drain=None))

    @staticmethod
    def fail():
        raise _Stop


@pytest.mark.parametrize("value", ["*", '{"a": 1}', "[1]"])
def test_allowed_origins_is_a_json_list_of_strings(value, capsys):
    with pytest.raises(SystemExit) as exited:
        _serve_args("--allowed-origins", value)
    assert exited.value.code == 2 and "--allowed-origins" in capsys.readouterr().err


def test_search_and_eval_settings_are_checked_before_the_models_load(tmp_path, capsys):
    """A misspelt strategy (or a DVTS beam width that does not divide n) was named only after both models
    had loaded; with a generator path that does not exist, the error shows that none was loaded."""
    absent = ["--generator", "/nonexistent/generator"]
    assert main(["search", *absent, "--strategy", "beem", "What is 1 + 1?"]) == 2
    assert capsys.readouterr().err.startswith("error: strategy: must be one of")
    dataset = tmp_path / "arith.jsonl"
    dataset.write_text('{"problem": "What is 1 + 1?", "answer": "2"}\n')
    assert main(["eval", *absent, "--strategy", "best_of_n,dvts", "--beam-width", "3", "--n", "4",
                 "--dataset", str(dataset), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: beam_width: n (4) must be a multiple")


class Loaded(Exception):
    """What `_configs_made` raises where a model would load."""


def _configs_made(monkeypatch) -> list:
    """The SearchConfigs `search` and `eval` make, collected; loading a model raises Loaded instead."""
    import treeserve.cli_search as cli_search

    def runtime(args):
        raise Loaded

    configs, real = [], cli_search._config
    monkeypatch.setattr(cli_search, "_runtime", runtime)
    monkeypatch.setattr(cli_search, "_config", lambda *a, **k: configs.append(real(*a, **k)) or configs[-1])
    return configs


def test_search_refuses_a_beam_width_over_n_as_the_server_does(monkeypatch, capsys):
    """An explicit --beam-width over --n was clamped to n without a word (8 with --n 4 searched with 4 beams),
    where /v1/search answers 400 for the same: it is an error naming both (exit 2), before any model
    loads. Left out, the default (4) still comes down to a smaller n."""
    absent = ["--generator", "/nonexistent/generator"]
    assert main(["search", *absent, "--n", "4", "--beam-width", "8", "What is 1 + 1?"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: beam_width:") and "n (4)" in error and "beam_width (8)" in error, error
    configs = _configs_made(monkeypatch)
    with pytest.raises(Loaded):
        main(["search", *absent, "--n", "2", "What is 1 + 1?"])
    with pytest.raises(Loaded):
        main(["search", *absent, "--n", "8", "--beam-width", "8", "What is 1 + 1?"])
    assert [(c.n, c.beam_width) for c in configs] == [(2, 2), (8, 8)]


def test_eval_refuses_a_beam_width_that_does_not_fit_an_n_of_its_grid(tmp_path, monkeypatch, capsys):
    """An explicit --beam-width over one N of eval's grid was taken at most that N without a word
    (`--beam-width 8 --n 4,16` searched N=4 with 4 beams and reported it as width 8's sweep): it is an
    error naming that N and the width (exit 2) before any model loads, as `search` and /v1/search
    refuse it. Left out, the default (4) still comes down to a smaller N."""
    absent, dataset = ["--generator", "/nonexistent/generator"], tmp_path / "arith.jsonl"
    dataset.write_text('{"problem": "What is 1 + 1?", "answer": "2"}\n')
    grid = ["eval", *absent, "--dataset", str(dataset), "--out", str(tmp_path / "out")]
    assert main([*grid, "--strategy", "beam", "--n", "16,4", "--beam-width", "8"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: beam_width:") and "n (4)" in error and "beam_width (8)" in error, error
    configs = _configs_made(monkeypatch)
    with pytest.raises(Loaded):
        main([*grid, "--strategy", "beam", "--n", "2,8"])
    with pytest.raises(Loaded):
        main([*grid, "--strategy", "dvts", "--n", "8,16", "--beam-width", "8"])
    assert [(c.n, c.beam_width) for c in configs] == [(2, 2), (8, 4), (8, 8), (16, 8)]


def test_eval_names_a_dataset_it_cannot_read(tmp_path, capsys):
    assert main(["eval", "--dataset", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: dataset: cannot read")  # (a bare [Errno 2] before)
    assert main(["eval", "--dataset", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "dataset: cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["run", "--modle", "builtin:arith-gen", "Hi"], "treeserve run: error: unrecognized arguments: --modle "
     "(did you mean --model?)"),  # its value is taken as a prompt, as argparse reads it
    (["search", "q", "--beamwidth", "4"], "treeserve search: error: unrecognized arguments: --beamwidth 4 "
     "(did you mean --beam-width?)"),
    (["serve", "--bogus"], "treeserve serve: error: unrecognized arguments: --bogus"),
    (["gateway", "keys", "create", "--modls", "m"], "treeserve gateway keys create: error: unrecognized arguments: "
     "--modls m (did you mean --models?)"),
])
def test_an_unknown_option_is_reported_by_its_subcommand(argv, said, capsys):
    """(it was `treeserve: error: unrecognized arguments: --modle` under the top command's usage, which
    lists only the subcommands, with no hint of the option meant)"""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == said
    assert err.startswith(f"usage: treeserve {' '.join(said.split(':')[0].split()[1:])} ")


def test_n_is_spelt_both_ways_on_run_and_search():
    """`run` took only -n and `search`/`eval` only --n: `treeserve run --n 2` was "ambiguous option: --n could
    match --no-enable-prefix-caching, ..." and `treeserve search -n 4` an unrecognized argument."""
    from treeserve.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["run", "--n", "2", "Hi"]).n == parse(["run", "-n", "2", "Hi"]).n == 2
    assert parse(["search", "-n", "8", "q"]).n == parse(["search", "--n", "8", "q"]).n == 8


def test_eval_and_tasks_export_take_n_both_ways_too(tmp_path, monkeypatch, capsys):
    """`treeserve eval -n 4` was "unrecognized arguments: -n 4 (did you mean --n?)" while `run` and `search`
    take both spellings; `tasks export` took only --n as well: every --n of the command line is -n too."""
    absent, dataset = ["--generator", "/nonexistent/generator"], tmp_path / "arith.jsonl"
    dataset.write_text('{"problem": "What is 1 + 1?", "answer": "2"}\n')
    configs = _configs_made(monkeypatch)
    with pytest.raises(Loaded):
        main(["eval", *absent, "--strategy", "best_of_n", "-n", "4,16", "--dataset", str(dataset),
              "--out", str(tmp_path / "out")])
    assert [c.n for c in configs] == [4, 16]
    out = tmp_path / "problems.jsonl"
    assert main(["tasks", "export", "-n", "3", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 3


@pytest.mark.parametrize("argv, flag", [
    (["run", "--model", "", "Hi"], "--model"), (["run", "--model", " ", "Hi"], "--model"),
    (["serve", "--model", ""], "--model"), (["serve", "--model", "gen=builtin:arith-gen", "--model", " "], "--model"),
    (["serve", ""], "model_path"), (["serve", " "], "model_path"), (["worker", "--broker", "amqp://x/", ""], "model_path"),
    (["memory", "--model", ""], "--model"),
    (["search", "--generator", "", "q"], "--generator"), (["search", "--verifier", " ", "q"], "--verifier"),
])
def test_an_empty_model_argument_is_an_error_naming_its_flag(argv, flag, monkeypatch, capsys):
    """`run --model ""` loaded the current folder (an empty path is '.') and failed naming '.'; `serve ""`
    served the bundled pair as if no model were given, and `--model " "` was "' ' is not a local directory"
    (serve: "NAME=PATH needs a name before '='", with no '=' given): each is argparse's error naming the flag."""
    import treeserve.server.launch as launch

    def loaded(args):
        raise Loaded
    monkeypatch.setattr(launch, "serve", loaded)
    monkeypatch.setattr(launch, "worker", loaded)
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: is empty" in last and "builtin:NAME" in last, last


def test_an_empty_model_path_is_an_error_not_the_current_folder(tmp_path, monkeypatch):
    """(LLM('') loaded the current folder: Path('') is '.')"""
    monkeypatch.chdir(tmp_path)
    for empty in ("", "  "):
        with pytest.raises(ValueError, match=r"^model: is empty"):
            resolve_model_path(empty)


@pytest.mark.parametrize("argv, flag, hint", [
    (["serve", "builtin:arith-gen", "--served-model-name", ""], "--served-model-name", "leave the flag out"),
    (["worker", "--broker", "amqp://x/", "--served-model-name", " "], "--served-model-name", "leave the flag out"),
    (["bench", "serve", "--base-url", "http://127.0.0.1:1", "--out", "o", "--model", ""], "--model", "GET /v1/models"),
    (["bench", "serve", "--base-url", "http://127.0.0.1:1", "--out", "o", "--tokenizer", ""], "--tokenizer",
     "tokenizer directory"),
    (["gateway", "--backend", "m=http://127.0.0.1:1", "--chat", "--chat-router", ""], "--chat-router",
     "leave the flag out"),
    (["gateway", "--backend", "m=http://127.0.0.1:1", "--database", ""], "--database", "TREESERVE_GATEWAY_DATABASE"),
    (["gateway", "keys", "list", "--database", ""], "--database", "TREESERVE_GATEWAY_DATABASE"),
    (["chat", "--database", " "], "--database", "TREESERVE_GATEWAY_DATABASE"),
    (["search", "--recipe", "", "q"], "--recipe", "the verifier's own"),
    (["search", "--recipe", " ", "q"], "--recipe", "known: rlhflow"),
    (["eval", "--agg-strategy", "", "--dataset", "d", "--out", "o"], "--agg-strategy", "the verifier's own"),
    (["gateway", "users", "create", "", "--database", "sqlite://"], "user_id", "the user's id"),  # (made user '')
    (["chat", "--user", ""], "--user", "the first user's name"),  # (made user '')
])
def test_an_empty_name_is_an_error_naming_its_flag(argv, flag, hint, monkeypatch, capsys):
    """`--served-model-name ""` served the model under its path's name; `bench serve --model ""` benchmarked
    the first model; `--chat-router ""` routed by the conversation's own model; `--database ""` used
    TREESERVE_GATEWAY_DATABASE or ./treeserve-gateway.db: each empty value was taken as the flag left out."""
    import treeserve.bench.run as bench_run
    import treeserve.cli_chat as cli_chat
    import treeserve.cli_gateway as cli_gateway
    import treeserve.cli_search as cli_search
    import treeserve.server.launch as launch

    def loaded(*args, **kwargs):
        raise Loaded
    for module, names in ((launch, ["serve", "worker"]), (bench_run, ["run_benchmark"]), (cli_chat, ["cmd_chat"]),
                          (cli_gateway, ["cmd_gateway", "cmd_keys_list", "cmd_users_create"]), (cli_search, ["cmd_search", "cmd_eval"])):
        for name in names:
            monkeypatch.setattr(module, name, loaded)
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: is empty" in last and hint in last, last


def test_an_empty_served_model_name_is_an_error_in_python():
    """(build_app(path, served_model_name="") served the model under its path's name)"""
    from treeserve.server.launch import build_app

    with pytest.raises(ValueError, match=r"^served_model_name: is empty"):
        build_app("builtin:arith-gen", served_model_name="")


@pytest.mark.parametrize("section, field", [({"database": ""}, "database"),
                                            ({"chat": {"enabled": True, "router_model": " "}}, "chat.router_model")])
def test_an_empty_database_or_router_in_the_gateway_config_is_an_error(section, field, tmp_path):
    """(a YAML `database: ""` used TREESERVE_GATEWAY_DATABASE or ./treeserve-gateway.db; `router_model: ""`
    the conversation's own model)"""
    import yaml

    from treeserve.errors import ParamError
    from treeserve.gateway.config_load import build_config

    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"models": {"m": {"backends": ["http://127.0.0.1:1"]}}, **section}))
    with pytest.raises(ParamError, match=rf"^{field}: is empty"):
        build_config([], path)


def test_a_kv_fraction_without_its_name_is_named(capsys):
    """(`--kv-fraction x` was "error: could not convert string to float: ''")"""
    assert main(["memory", "--kv-mode", "static", "--kv-fraction", "x"]) == 2
    assert "--kv-fraction: expected NAME=FRACTION (e.g. gen=0.6), got 'x'" in capsys.readouterr().err


def test_a_broker_not_reached_is_one_line_not_a_traceback(caplog):
    """(`treeserve worker --broker amqp://host-without-rabbitmq/` logged two chained tracebacks before its
    one-line error)"""
    from treeserve.ports import free_port
    from treeserve.server.broker_worker import BrokerWorker

    worker = BrokerWorker(f"amqp://127.0.0.1:{free_port()}/", "http://127.0.0.1:1", ["m"])
    worker.start().join(30)
    assert isinstance(worker.error, OSError)
    (record,) = [r for r in caplog.records if r.name == "treeserve.worker"]
    assert record.getMessage().startswith("the broker consumer failed: ") and record.exc_info is None


def test_an_unknown_recipe_is_named_by_its_flag(capsys):
    """(it was "error: recipes: prm: unknown recipe 'nope'", the Runtime's names for the flag and the model)"""
    with pytest.raises(SystemExit) as stopped:
        main(["search", "--recipe", "nope", "q"])
    assert stopped.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --recipe: unknown recipe 'nope'; known: rlhflow, math-shepherd" in last, last


@pytest.mark.parametrize("broker, shown", [
    ("treeserve:s3cret@mq.internal/", "treeserve:***@mq.internal/"),  # the scheme left out
    ("pyamqp://guest:s3cret@mq/", "pyamqp://guest:***@mq/"),  # Celery's (kombu's) scheme, not aio-pika's
])
def test_a_broker_url_refused_is_said_without_its_password(broker, shown, capsys):
    """(the error printed the URL as given, password included, where every other URL an error names
    shows it as ***)"""
    with pytest.raises(SystemExit):
        main(["worker", "--broker", broker])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --broker:" in last and repr(shown) in last and "s3cret" not in last


@pytest.mark.parametrize("argv, dest, url", [
    (["worker", "--broker", "AMQP://guest:guest@mq/"], "broker", "amqp://guest:guest@mq/"),
    (["worker", "--broker", "Amqps://mq/"], "broker", "amqps://mq/"),
    (["bench", "serve", "--base-url", "HTTP://127.0.0.1:8000", "--out", "o"], "base_url", "http://127.0.0.1:8000"),
])
def test_a_url_scheme_in_capitals_is_taken(argv, dest, url):
    """(a scheme is case-insensitive, RFC 3986 3.1, as aio-pika and httpx read it: AMQP://host/ and
    HTTP://host were refused as URLs without their scheme)"""
    from treeserve.cli import build_parser
    assert getattr(build_parser().parse_args(argv), dest) == url


@pytest.mark.parametrize("argv", [
    ["gateway", "--backend", "m=http://127.0.0.1:1", "--port", "0"],
    ["gateway", "keys", "list"],
    ["gateway", "db", "upgrade"],
    ["chat", "--port", "0"],
])
@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_database_variable_is_an_error_naming_it(argv, value, monkeypatch, tmp_path, capsys):
    """(TREESERVE_GATEWAY_DATABASE="" was taken as unset: ./treeserve-gateway.db, where an empty --database
    or `database: ""` is an error; `treeserve chat` says it before starting the model server)"""
    import treeserve.cli_chat as cli_chat
    import treeserve.gateway.launch as gateway_launch

    def started(*args, **kwargs):
        raise Loaded
    monkeypatch.setattr(gateway_launch, "run_gateway", started)
    monkeypatch.setattr(cli_chat.subprocess, "Popen", started)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREESERVE_GATEWAY_DATABASE", value)
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: TREESERVE_GATEWAY_DATABASE: is empty"), last
    assert not (tmp_path / "treeserve-gateway.db").exists()


def test_a_broker_workers_own_os_error_keeps_its_traceback(caplog, monkeypatch):
    """(any OSError was logged as a broker not reached, in one line: a file of our own missing, e.g. a TLS
    certificate, lost its traceback; only a connection error is said so)"""
    import treeserve.server.broker_worker as broker_worker
    from treeserve.server.broker_worker import BrokerWorker

    async def connect(url):
        raise FileNotFoundError(2, "No such file or directory", "/etc/treeserve/ca.pem")
    monkeypatch.setattr(broker_worker.aio_pika, "connect_robust", connect)
    worker = BrokerWorker("amqp://127.0.0.1:1/", "http://127.0.0.1:1", ["m"])
    worker.start().join(30)
    assert isinstance(worker.error, FileNotFoundError)
    (record,) = [r for r in caplog.records if r.name == "treeserve.worker"]
    assert record.getMessage() == "the broker consumer failed" and record.exc_info is not None
