"""`treeserve chat`'s database: the one every gateway command reads (--database, else
TREESERVE_GATEWAY_DATABASE, else ./treeserve-gateway.db), named without its password. The model server
and the serving are stand-ins: what is checked is where the first user is made and what is printed."""
import re
import subprocess
from types import SimpleNamespace

import pytest

from treeserve import cli_chat
from treeserve.cli import main
from treeserve.gateway.chat.store import ChatStore
from treeserve.gateway.store import Store
from treeserve.ports import free_port


class FakeServer:
    """The model server `treeserve chat` starts, never started."""
    pid = 0
    started = 0

    def __init__(self, *args, **kwargs):
        FakeServer.started += 1

    def wait(self, timeout=None):
        return 0

    terminate = kill = wait


@pytest.fixture
def chat_without_models(monkeypatch):
    """`treeserve chat` with its model server and its serving stood in for; the apps it built, kept."""
    import treeserve.bench.health as health
    import treeserve.gateway.launch as launch

    apps = []
    monkeypatch.setattr(cli_chat, "subprocess", SimpleNamespace(Popen=FakeServer, TimeoutExpired=subprocess.TimeoutExpired))
    monkeypatch.setattr(health, "wait_healthy", lambda *args, **kwargs: None)
    monkeypatch.setattr(launch, "run_gateway", lambda app, *args, **kwargs: apps.append(app) or 0)
    yield apps
    for app in apps:
        app.state.store.close()


def _password(out: str) -> str:
    return re.search(r"password: (\S+)", out).group(1)


def test_chat_uses_the_gateways_database_variable(chat_without_models, database, tmp_path, monkeypatch, capsys):
    """(chat made its first user in ./treeserve-gateway.db, and printed that path, while the gateway it
    started read TREESERVE_GATEWAY_DATABASE: the user printed could not sign in; a password in the URL
    would have been printed as given)"""
    url = database.replace("postgres@", "postgres:s3cret-pw@")  # (the test cluster trusts: the password is unused)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREESERVE_GATEWAY_DATABASE", url)
    assert main(["chat", "--port", str(free_port())]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "treeserve-gateway.db").exists()
    store = Store(url)
    try:
        assert ChatStore(store.db, store.accounts).check_password("demo", _password(out))
    finally:
        store.close()
    where = re.search(r"history kept in (\S+);", out).group(1)
    assert "s3cret-pw" not in out
    assert where == (url.removeprefix("sqlite:///") if url.startswith("sqlite") else
                     url.replace(":s3cret-pw@", ":***@"))
    (app,) = chat_without_models
    assert app.state.config.database == url


def test_chat_database_flag_comes_first(chat_without_models, tmp_path, monkeypatch, capsys):
    flag, variable = tmp_path / "flag.db", tmp_path / "variable.db"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREESERVE_GATEWAY_DATABASE", f"sqlite:///{variable}")
    assert main(["chat", "--port", str(free_port()), "--database", f"sqlite:///{flag}"]) == 0
    assert f"history kept in {flag};" in capsys.readouterr().out
    assert flag.exists() and not variable.exists() and not (tmp_path / "treeserve-gateway.db").exists()


def test_chat_without_a_database_uses_the_working_directory(chat_without_models, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TREESERVE_GATEWAY_DATABASE", raising=False)
    assert main(["chat", "--port", str(free_port())]) == 0
    assert f"history kept in {tmp_path / 'treeserve-gateway.db'};" in capsys.readouterr().out
    assert (tmp_path / "treeserve-gateway.db").exists()


@pytest.mark.parametrize("argv, error", [
    (["--chat-tool", "x"], "chat.tools: unknown tool 'x'"),
    (["--database", "nope://x"], "database URL driver 'nope' is not supported"),
])
def test_chat_says_a_wrong_setting_before_the_models_load(argv, error, chat_without_models, tmp_path, monkeypatch,
                                                          capsys):
    """(a wrong --chat-tool or --database was said after the model server had loaded its three models)"""
    monkeypatch.chdir(tmp_path)
    FakeServer.started = 0
    assert main(["chat", "--port", str(free_port()), *argv]) == 2
    assert error in capsys.readouterr().err
    assert FakeServer.started == 0


def test_chat_says_a_database_not_reached_in_one_line(chat_without_models, tmp_path, monkeypatch, capsys):
    """(a database that could not be opened was SQLAlchemy's traceback, where every gateway command says it
    in one line naming the database)"""
    monkeypatch.chdir(tmp_path)
    FakeServer.started = 0
    missing = tmp_path / "missing" / "gw.db"
    assert main(["chat", "--port", str(free_port()), "--database", f"sqlite:///{missing}"]) == 2
    err = capsys.readouterr().err
    assert f"error: database {missing}: cannot be reached (unable to open database file)" in err
    assert "Traceback" not in err and FakeServer.started == 0
