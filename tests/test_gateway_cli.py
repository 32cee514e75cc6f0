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
    url = f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}"
    assert main(["gateway", "keys", "list", "--database", url]) == 2
    assert capsys.readouterr().err.strip() == ("error: database: cannot be reached (unable to open database file); "
                                                "check --database or TREESERVE_GATEWAY_DATABASE")
