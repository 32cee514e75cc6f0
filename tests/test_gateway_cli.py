"""`treeserve gateway keys|users|db ...`: which database they use, and what a newcomer is told when
they give the serving gateway's options or a database that cannot be reached."""
import json

import pytest

from treeserve.cli_gateway import main


def test_database_given_before_the_subcommand_is_the_one_used(tmp_path, monkeypatch, capsys):
    """(`treeserve gateway --database URL keys create` made the key in ./treeserve-gateway.db: the
    subcommand's own --database, unset, replaced the one given before it)"""
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'chosen.db'}"
    assert main(["gateway", "--database", url, "keys", "create", "--alias", "first"]) == 0
    capsys.readouterr()
    assert not (tmp_path / "treeserve-gateway.db").exists()
    assert main(["gateway", "keys", "list", "--database", url]) == 0
    assert [k["key_alias"] for k in json.loads(capsys.readouterr().out)] == ["first"]


@pytest.mark.parametrize("before", [["--config", "gateway.yaml"], ["--master-key", "sk-x", "--port", "4001"]])
def test_the_serving_gateways_options_on_a_management_command_are_refused(tmp_path, monkeypatch, capsys, before):
    """(they were dropped: a --config naming a PostgreSQL database made the key in ./treeserve-gateway.db)"""
    monkeypatch.chdir(tmp_path)
    assert main(["gateway", *before, "keys", "list"]) == 2
    flags = ", ".join(flag for flag in before if flag.startswith("--"))
    assert capsys.readouterr().err.strip() == (
        f"error: {flags}: options of the serving gateway; `treeserve gateway keys` reads none of them "
        "(--database says where the keys and users are)")
    assert not (tmp_path / "treeserve-gateway.db").exists()


def test_a_database_that_cannot_be_reached_is_said_without_a_traceback(tmp_path, capsys):
    """(it was SQLAlchemy's OperationalError traceback)"""
    path = tmp_path / "no" / "such" / "dir.db"
    assert main(["gateway", "keys", "list", "--database", f"sqlite:///{path}"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: database {path}: cannot be reached (unable to open database "
                                                "file); check --database or TREESERVE_GATEWAY_DATABASE")


def test_the_serving_gateway_names_a_database_it_cannot_open_in_one_line(tmp_path, capsys):
    """(`treeserve gateway --database sqlite:///no/such/dir.db` started uvicorn, whose startup printed
    SQLAlchemy's traceback and 'Application startup failed': exit 1)"""
    path = tmp_path / "no" / "such" / "dir.db"
    assert main(["gateway", "--database", f"sqlite:///{path}", "--port", "8311",
                 "--backend", "m=http://127.0.0.1:8312"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"error: database {path}: cannot be reached (unable to open database "
                                            "file); check --database or TREESERVE_GATEWAY_DATABASE")


@pytest.mark.parametrize("url, shown", [
    ("postgresql+psycopg://alice:s3cret@127.0.0.1:8313/gw", "postgresql+psycopg://alice:***@127.0.0.1:8313/gw"),
    ("postgresql://127.0.0.1:8313/gw?user=alice&password=s3cret",
     "postgresql://127.0.0.1:8313/gw?password=***&user=alice"),
])
def test_an_unreachable_databases_url_is_named_without_its_password(url, shown, capsys):
    assert main(["gateway", "keys", "list", "--database", url]) == 2
    err = capsys.readouterr().err
    assert "s3cret" not in err
    assert err.startswith(f"error: database {shown}: cannot be reached (connection failed: ")


def test_the_serving_gateway_reads_the_database_the_key_commands_read(tmp_path, monkeypatch, capsys):
    """TREESERVE_GATEWAY_DATABASE (the database of `treeserve gateway keys create` without --database) is the
    serving gateway's too: it served ./treeserve-gateway.db, where none of those keys were."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "no" / "such" / "env.db"
    monkeypatch.setenv("TREESERVE_GATEWAY_DATABASE", f"sqlite:///{path}")
    assert main(["gateway", "--port", "8314", "--backend", "m=http://127.0.0.1:8315"]) == 2
    assert f"error: database {path}: cannot be reached" in capsys.readouterr().err
    assert not (tmp_path / "treeserve-gateway.db").exists()


def test_db_downgrade_to_a_revision_that_does_not_exist_is_named(tmp_path, capsys):
    """(it was Alembic's CommandError with its traceback, exit 1)"""
    database = f"sqlite:///{tmp_path / 'gw.db'}"
    assert main(["gateway", "db", "upgrade", "--database", database]) == 0
    assert main(["gateway", "db", "downgrade", "zzz", "--database", database]) == 2
    err = capsys.readouterr().err
    assert "error: revision 'zzz': Can't locate revision identified by 'zzz'" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, shown", [
    (["gateway", "keys", "list", "--database", "alice:s3cret@db.internal/gw"], "'alice:***@db.internal/gw'"),
    (["gateway", "--port", "0", "--backend", "m=alice:s3cret@h:1"], "'m=alice:***@h:1'"),
])
def test_a_url_without_its_scheme_is_said_without_its_password(argv, shown, tmp_path, monkeypatch, capsys):
    """(a database URL without its scheme was SQLAlchemy's traceback, and an error naming such a URL
    printed its password: `--backend m=user:pw@host`, as the shown URL of a backend or database)"""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "s3cret" not in err and "Traceback" not in err
    assert err.startswith("error: ") and shown in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("url, shown", [
    ("http://h:1/v1?api_key=SECRET", "http://h:1/v1?api_key=***"),
    ("https://h/v1?api-version=2024-02-01&key=SECRET", "https://h/v1?api-version=2024-02-01&key=***"),
    ("https://alice:SECRET@h/v1?sig=SECRET#f", "https://alice:***@h/v1?sig=***#f"),
    ("http://h:1/v1?SECRET", "http://h:1/v1?***"),
    ("h:1/v1?token=SECRET", "h:1/v1?token=***"),  # (no scheme)
    # a broker's connection settings are no secret: its label (metrics) as it was, its key file's password hidden
    ("amqp://alice:SECRET@mq/?heartbeat=30&name=gw&keyfile_password=SECRET",
     "amqp://alice:***@mq/?heartbeat=30&name=gw&keyfile_password=***"),
])
def test_a_backend_urls_query_is_shown_without_its_values(url, shown):
    """A key in a backend URL's query (`?api_key=`, Google's `?key=`, a signed URL's `sig=`) is hidden wherever
    a password is: errors and logs (redact_url), the backend's label (metrics, spend rows, /model/info), and an
    error's text that quotes the URL. It was shown whole."""
    from treeserve.gateway.config import BackendConfig, redact_url, scrubbed

    assert redact_url(url) == shown and "SECRET" not in shown
    if "://" in url:
        assert "SECRET" not in BackendConfig(url).name and BackendConfig(url).name.endswith(shown.split("@")[-1].split("//")[-1])
        assert scrubbed(f"error at {url} (SECRET)", url) == "error at " + url.replace("SECRET", "***") + " (***)"


def test_the_shown_urls_hide_a_password_without_a_scheme():
    from treeserve.gateway.config import redact_url
    from treeserve.gateway.database import shown_url

    assert shown_url("alice:s3cret@db.internal/gw") == "alice:***@db.internal/gw"
    assert redact_url("alice:s3cret@h:1") == "alice:***@h:1"
    assert redact_url("http://alice:s3cret@h:99999") == "http://alice:***@h:99999"  # (urllib: port out of range)
    assert redact_url("http://alice:s3cret@h:1/v1") == "http://alice:***@h:1/v1"


@pytest.mark.parametrize("url, shown", [
    ("http://alice:SECRET@h:1/v1", "http://alice:***@h:1/v1"),
    ("amqp://treeserve:SECRET@mq.internal/", "amqp://treeserve:***@mq.internal/"),
    ("http://alice:SECRET@[::1]:8000/v1", "http://alice:***@[::1]:8000/v1"),  # (was http://::1:8000/v1)
    ("http://alice:SEC%40RET@h:1", "http://alice:***@h:1"),
    ("http://alice:SEC@RET@h:1", "http://alice:***@h:1"),  # (urllib: the password is up to the last @)
    ("http://alice:SEC/RET@h:1", "http://alice:***@h:1"),  # (urllib: port "SEC"; it was shown whole)
    ("http://alice:SEC#RET@h:1/v1", "http://alice:***@h:1/v1"),
    ("http://alice:SEC?RET@h:1", "http://alice:***@h:1"),
    ("http://alice:SECRET@h:99999", "http://alice:***@h:99999"),  # (a port out of range)
    ("https://SECRET@api.example.com/v1", "https://***@api.example.com/v1"),  # (a key as the user)
    ("https://SECRET:@api.example.com/v1", "https://***@api.example.com/v1"),  # (a key as the user, Stripe's)
    ("https://:SECRET@api.example.com/v1", "https://***@api.example.com/v1"),
    ("alice:SECRET@h:1", "alice:***@h:1"),  # (no scheme)
    ("SECRET@h:1", "***@h:1"),  # (no scheme, a key as the user: it was shown whole)
    ("m=alice:SEC/RET@h:1", "m=alice:***@h:1"),  # (--backend's MODEL=URL, as its error names it)
    ("http://h:1/v1", "http://h:1/v1"),
    ("amqp://mq.internal/", "amqp://mq.internal/"),
])
def test_a_backend_url_is_shown_with_its_user_and_never_its_password(url, shown):
    """A URL in errors and logs keeps its user, as SQLAlchemy's
    `render_as_string(hide_password=True)` shows a database's (`amqp://alice:***@mq/`; it was `amqp://mq/`, and an
    error about a broker or server URL did not say which account it used); a user with no password may be a key,
    shown as ***; a URL urllib cannot split (no scheme, a port out of range, a "/" in its password) too. A
    backend's label (metrics, spend rows, /model/info for key holders) names no account."""
    from treeserve.gateway.config import BackendConfig, redact_url
    from treeserve.gateway.database import shown_url

    assert redact_url(url) == shown
    assert "SEC" not in shown and "RET" not in shown
    if url.startswith(("http://", "https://", "amqp://")) and ":99999" not in url:
        label = BackendConfig(url).name  # (a backend's label: no account at all, whoever it signs in as)
        scheme, _, rest = url.partition("://")
        assert label == f"{scheme}://{rest.rpartition('@')[2]}" and "alice" not in label
    if "://" not in url:
        assert shown_url(url) == shown  # (a database URL SQLAlchemy cannot read: shown the same way)


@pytest.mark.parametrize("command, field", [
    (["keys", "create", "--max-budget", "inf"], "max_budget"),
    (["keys", "create", "--soft-budget", "nan"], "soft_budget"),
    (["keys", "create", "--rpm-limit", "99999999999"], "rpm_limit"),
    (["users", "create", "ann", "--max-budget", "inf"], "max_budget")])
def test_an_amount_or_limit_the_admin_api_refuses_is_refused_by_the_command_line_too(tmp_path, capsys, command, field):
    """(`keys create --max-budget inf` stored an infinite budget, printed `Infinity`, which is not JSON, and
    every admin answer naming the key, /key/info and /key/list?return_full_object=true, was then a 400 "Out
    of range float values are not JSON compliant"; `nan` was stored as no budget at all on SQLite; an
    rpm_limit past an INTEGER column's range was stored, where the admin API refuses each of them)"""
    url = f"sqlite:///{tmp_path / 'gateway.db'}"
    assert main(["gateway", *command, "--database", url]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {field}: must be ")
    assert main(["gateway", "keys", "list", "--database", url]) == 0
    assert json.loads(capsys.readouterr().out) == []  # (nothing made)
