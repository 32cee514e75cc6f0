"""The gateway's configuration checked at load: each value's type and range (a numeric string such
as PyYAML's '1e-6' taken as its number), unknown and duplicate keys, a section of the wrong kind, a
YAML syntax error, a URL without a scheme, a URL's credentials with an api_key: each a one-line
error naming the field (and the model), exit 2 from the command line, never a traceback."""
from __future__ import annotations

import textwrap

import pytest

from treeserve.cli_gateway import main
from treeserve.errors import ParamError
from treeserve.gateway.config_load import build_config

GOOD_MODEL = "models:\n  m:\n    backends: [http://127.0.0.1:8381]\n"


def _load(tmp_path, text: str):
    path = tmp_path / "gateway.yaml"
    path.write_text(textwrap.dedent(text))
    return build_config(config_file=path)


def test_prices_written_as_yaml_1_1_reads_them_are_numbers(tmp_path):
    config = _load(tmp_path, GOOD_MODEL + "    input_cost_per_token: 1e-6\n    output_cost_per_token: 2e-6\n")
    model = config.models["m"]
    assert (model.input_cost_per_token, model.output_cost_per_token) == (1e-6, 2e-6)
    assert isinstance(model.input_cost_per_token, float)


@pytest.mark.parametrize("text, named", [
    (GOOD_MODEL + "    input_cost_per_token: cheap\n", "models.m.input_cost_per_token: expected a number"),
    (GOOD_MODEL + "    output_cost_per_token: -1\n", "models.m.output_cost_per_token: expected a number >= 0"),
    (GOOD_MODEL + "    max_tokens: 0\n", "models.m.max_tokens: expected a whole number >= 1"),
    (GOOD_MODEL + "    fallbacks: other\n", "models.m.fallbacks: expected a list"),
    (GOOD_MODEL + "retries: -1\n", "retries: expected a whole number >= 0"),
    (GOOD_MODEL + "retries: '2'\n", "retries: expected a whole number >= 0"),
    (GOOD_MODEL + "health_interval: soon\n", "health_interval: expected a number"),
    (GOOD_MODEL + "breaker_failures: 0\n", "breaker_failures: expected a whole number >= 1"),
    ("models:\n  m:\n    backends: [{url: http://h:1, timeout: -5}]\n", "models.m.backends[0].timeout"),
    ("models:\n  m:\n    backends: [{url: http://h:1, connect_timeout: x}]\n", "models.m.backends[0].connect_timeout"),
    ("models:\n  m:\n    backends: [127.0.0.1:8000]\n", "models.m.backends[0].url: expected http(s)://"),
    ("models:\n  m:\n    backends: [{url: 'http://u:secret@h:1', api_key: sk-x}]\n",
     "models.m.backends[0].api_key: backend http://u:***@h:1: a URL with a user and password and an api_key"),
    ("model_list:\n  - model_name: m\n" + GOOD_MODEL, "config: unknown key 'model_list'"),
    (GOOD_MODEL + "    input_cost: 1\n", "models.m: unknown key 'input_cost'"),
    ("models:\n  m:\n    backends: [{url: http://h:1, apikey: sk-x}]\n", "models.m.backends[0]: unknown key 'apikey'"),
    ("models:\n  m:\n    backends: [{api_key: sk-x}]\n", "models.m.backends[0].url: expected a URL, got None"),
    ("models:\n  - m\n", "models: expected a mapping"),
    ("models:\n  m: http://h:1\n", "models.m: expected a mapping"),
    ("models:\n  m:\n    backends: http://h:1\n", "models.m.backends: expected a list"),
    (GOOD_MODEL + "chat: {enabled: true, colour: red}\n", "chat: unknown key 'colour'"),
    (GOOD_MODEL + "  m:\n    backends: [http://127.0.0.1:8382]\n", "the key 'm' is given twice"),
    ("models:\n  m: [unclosed\n", "config: "),
])
def test_a_bad_config_is_a_one_line_error_naming_its_field(tmp_path, capsys, monkeypatch, text, named):
    monkeypatch.setattr("treeserve.gateway.launch.run_gateway", lambda *args: 0)  # (never serves)
    with pytest.raises(ParamError) as error:
        _load(tmp_path, text)
    assert named in str(error.value) and "\n" not in str(error.value)
    assert "secret" not in str(error.value)
    assert main(["gateway", "--config", str(tmp_path / "gateway.yaml"), "--port", "8389"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and len(err.strip().splitlines()) == 1


def test_a_yaml_syntax_error_names_its_line(tmp_path):
    with pytest.raises(ParamError, match=r"gateway.yaml: line 4, column \d+: "):
        _load(tmp_path, "models:\n  m:\n    backends: [http://h:1\n    x: 1\n")


def test_a_backend_url_loses_its_trailing_slash(tmp_path):
    config = _load(tmp_path, "models:\n  m:\n    backends: [http://h:1/, {url: 'http://h:2/'}]\n")
    assert [b.url for b in config.models["m"].backends] == ["http://h:1", "http://h:2"]


def test_anchors_merged_into_a_mapping_and_null_timeouts_still_load(tmp_path):
    """What loaded before the checks still does: `<<: *anchor` merges (the duplicate-key check read
    the merge key itself and refused it), and a null timeout (no limit) on a backend."""
    config = _load(tmp_path, """\
        models:
          m:
            backends:
              - &first {url: 'http://h:1', timeout: null, connect_timeout: null}
              - {<<: *first, url: 'http://h:2'}
        """)
    backends = config.models["m"].backends
    assert [b.url for b in backends] == ["http://h:1", "http://h:2"]
    assert all(b.timeout is None and b.connect_timeout is None for b in backends)


def test_gateway_help_names_each_default_the_config_takes():
    """`treeserve gateway --help` says what a flag left out means: the routing, retries and health
    interval a gateway without them uses (GatewayConfig's defaults)."""
    import argparse

    from treeserve.cli_gateway import add_gateway_parsers
    from treeserve.gateway.config import GatewayConfig

    parser = argparse.ArgumentParser()
    add_gateway_parsers(parser.add_subparsers(dest="command"))
    gateway = parser._subparsers._group_actions[0].choices["gateway"]
    helps = {action.dest: action.help or "" for action in gateway._actions}
    defaults = GatewayConfig(models={})
    assert f"default {defaults.routing}" in helps["routing"]
    assert f"default {defaults.retries}" in helps["retries"]
    assert f"default {defaults.health_interval:g}" in helps["health_interval"]


def test_a_backend_url_scheme_in_capitals_is_taken(tmp_path):
    """(a scheme is case-insensitive, RFC 3986 3.1: HTTP://host and AMQP://host were refused, in the
    file and in --backend; kept in lower case, an amqp:// URL is still told from an HTTP one)"""
    config = _load(tmp_path, "models:\n  m:\n    backends: [HTTP://h:1, {url: 'AMQP://guest:guest@mq/'}]\n")
    assert [b.url for b in config.models["m"].backends] == ["http://h:1", "amqp://guest:guest@mq"]
    flags = build_config(["m=Https://h:2", "w=AMQPS://mq"])
    assert [flags.models[m].backends[0].url for m in ("m", "w")] == ["https://h:2", "amqps://mq"]


def test_a_backend_url_without_its_scheme_is_refused_without_its_password(tmp_path):
    """(urllib reads `alice:s3cret@h:1` as scheme `alice`, no host: the error printed it whole)"""
    with pytest.raises(ParamError) as error:
        _load(tmp_path, "models:\n  m:\n    backends: ['alice:s3cret@h:1']\n")
    assert "models.m.backends[0].url" in str(error.value) and "'alice:***@h:1'" in str(error.value)
    assert "s3cret" not in str(error.value)
