"""`treeserve gateway`: serve the gateway, or manage its keys and users from the command line
(`treeserve gateway keys create|list|delete`, `treeserve gateway users create`, `treeserve gateway db
upgrade|downgrade`). Imports no engine."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from treeserve.arg_types import database_url, given, port, served_name
from treeserve.lifecycle import freeze_startup_heap

BUDGET_HELP = ("in the currency of the models' prices (input_cost_per_token, output_cost_per_token in the "
               "gateway's --config YAML); without prices every request costs 0 and the budget never acts")


def add_gateway_parsers(sub) -> None:
    from treeserve.cli_chat import add_chat_parser

    add_chat_parser(sub)
    gateway = sub.add_parser("gateway", help="OpenAI-compatible gateway: keys, budgets, billing, routing over replicas")
    gateway.add_argument("--backend", action="append", default=[],
                         help="MODEL=URL, repeatable; several URLs for one model are its replicas")
    gateway.add_argument("--config", type=Path, help="a YAML file: models (backends, prices, fallbacks), "
                         "master_key, database, routing, retries, ...")
    gateway.add_argument("--master-key", help="the admin key (or TREESERVE_MASTER_KEY)")
    gateway.add_argument("--database", type=database_url, help="a SQLAlchemy URL (default: SQLite treeserve-gateway.db in the "
                         "working directory; postgresql+psycopg://user:pass@host/db for production)")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=port, default=4000)
    gateway.add_argument("--routing", choices=["round_robin", "least_outstanding", "affinity"],
                         help="how a request picks among a model's replicas (default least_outstanding)")
    gateway.add_argument("--retries", type=int, help="further backends to try before a first byte (default 2)")
    gateway.add_argument("--health-interval", type=float, help="seconds between health checks (default 5; 0: off)")
    gateway.add_argument("--shutdown-timeout", type=float, help="on SIGTERM or SIGINT, seconds the requests in flight "
                         "may take to finish while new ones get 503 and /health/ready turns 503 (default 30); a "
                         "second signal exits at once")
    gateway.add_argument("--chat", action="store_true", help="serve the web chat at /chat (users sign in with "
                         "the passwords set by /user/new or `treeserve gateway users create --password`)")
    gateway.add_argument("--chat-verifier", action="append", default=[], metavar="MODEL=PRM",
                         help="search mode for MODEL, verified by the PRM model PRM (repeatable)")
    gateway.add_argument("--chat-router", metavar="MODEL", type=served_name, help="tools mode's function-calling model "
                         "(default: the conversation's model)")
    gateway.add_argument("--chat-tool", action="append", default=[], metavar="NAME=URL",
                         help="an HTTP tool for tools mode: weather=URL or wikipedia=URL (asked GET URL?q=...)")
    gateway.set_defaults(func=cmd_gateway)
    manage = gateway.add_subparsers(dest="gateway_command")
    keys = manage.add_parser("keys", help="create, list or delete keys in the gateway's database")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    create = key_commands.add_parser("create", help="create a key and print it (shown this once)")
    _add_database(create)
    create.add_argument("--user-id")
    create.add_argument("--alias", dest="key_alias")
    create.add_argument("--models", help="comma-separated models the key may use (default: all)")
    create.add_argument("--max-budget", type=float, help=BUDGET_HELP)
    create.add_argument("--soft-budget", type=float, help="a spend past which the gateway logs a warning "
                        "(LiteLLM's soft budget; nothing is refused)")
    create.add_argument("--budget-duration", help="budget period, e.g. 30d")
    create.add_argument("--rpm-limit", type=int)
    create.add_argument("--tpm-limit", type=int)
    create.add_argument("--max-parallel-requests", type=int)
    create.add_argument("--duration", help="lifetime, e.g. 12h (default: no expiry)")
    create.set_defaults(func=cmd_keys_create)
    listing = key_commands.add_parser("list", help="list keys (their hashes and display names, never secrets)")
    _add_database(listing)
    listing.add_argument("--user-id")
    listing.set_defaults(func=cmd_keys_list)
    delete = key_commands.add_parser("delete", help="delete keys (the key or its hash)")
    _add_database(delete)
    delete.add_argument("keys", nargs="+")
    delete.set_defaults(func=cmd_keys_delete)
    users = manage.add_parser("users", help="create users in the gateway's database")
    user_commands = users.add_subparsers(dest="users_command", required=True)
    new_user = user_commands.add_parser("create", help="create a user")
    _add_database(new_user)
    new_user.add_argument("user_id", type=given("give the user's id"))
    new_user.add_argument("--max-budget", type=float, help=BUDGET_HELP)
    new_user.add_argument("--budget-duration")
    new_user.add_argument("--models", help="comma-separated models the user's keys may use (default: all)")
    new_user.add_argument("--password", help="for the web chat, stored as an Argon2id hash (TREESERVE_PASSWORD "
                          "is better: a flag shows in `ps`)")
    new_user.add_argument("--no-key", dest="auto_create_key", action="store_false",
                          help="make the user only (by default a key for the user is made and printed, shown this "
                          "once, as /user/new does; its `auto_create_key: false`)")
    new_user.set_defaults(func=cmd_users_create)
    password = user_commands.add_parser("set-password", help="set a user's web chat password")
    _add_database(password)
    password.add_argument("user_id")
    password.add_argument("--password", help="the new password (default: TREESERVE_PASSWORD, else asked)")
    password.set_defaults(func=cmd_users_set_password)
    db = manage.add_parser("db", help="the gateway's database schema (Alembic revisions)")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_commands.add_parser("upgrade", help="bring the schema to the newest revision (as a gateway "
                                     "does when it starts) and print it")
    _add_database(upgrade)
    upgrade.set_defaults(func=cmd_db_upgrade)
    downgrade = db_commands.add_parser("downgrade", help="take the schema back to REVISION (before running an "
                                       "older treeserve on it; on SQLite with foreign keys off, so rebuilt tables "
                                       "keep their rows) and print it")
    _add_database(downgrade)
    downgrade.add_argument("revision", help="a revision id (0001, 0002, ...), or -N for N revisions back")
    downgrade.set_defaults(func=cmd_db_downgrade)


def _add_database(parser: argparse.ArgumentParser) -> None:
    # (SUPPRESS: `treeserve gateway --database URL keys list`, the flag before the subcommand, is kept;
    # a default here replaced it with None, and the command used ./treeserve-gateway.db)
    parser.add_argument("--database", default=argparse.SUPPRESS, type=database_url,
                        help="the gateway's database URL (default: ./treeserve-gateway.db)")


def serving_options_given(gateway: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The serving gateway's options given to a management command (`treeserve gateway --config
    gateway.yaml keys create`), which reads none of them: only --database says where the keys are."""
    return [action.option_strings[0] for action in gateway._actions
            if action.option_strings and action.dest not in ("help", "database")
            and getattr(args, action.dest, action.default) != action.default]


def _store(args):
    store = _unmigrated_store(args)
    store.migrate()
    return store


def _unmigrated_store(args):
    from treeserve.gateway.database import configured_url
    from treeserve.gateway.store import Store

    store = Store(configured_url(args.database))
    store.db.reach()
    return store


def _models(text: str | None) -> list[str] | None:
    return [m.strip() for m in text.split(",") if m.strip()] if text else None


def cmd_gateway(args) -> int:
    from treeserve.gateway.config_load import build_config
    from treeserve.ports import PortUnavailableError, bind_sockets, closing_all

    config = build_config(args.backend, args.config, master_key=args.master_key, database=args.database,
                          routing=args.routing, retries=args.retries, health_interval=args.health_interval,
                          shutdown_timeout=args.shutdown_timeout, chat=chat_overrides(args))
    try:  # held from now on: a taken port is said before the app is built, and no one takes it meanwhile
        sockets = bind_sockets(args.host, args.port, "--port")
    except PortUnavailableError as error:
        print(f"treeserve gateway: {error}", file=sys.stderr)
        return 2
    with closing_all(sockets):
        return _gateway_on(sockets, config, args)


def _gateway_on(sockets: list, config, args) -> int:
    """The gateway built from its config and served on `sockets`, bound before it was built."""
    from treeserve.gateway.app import build_app
    from treeserve.gateway.database import configured_url
    from treeserve.gateway.launch import run_gateway
    from treeserve.gateway.store import Store

    if not config.master_key:
        print("warning: no --master-key: the admin API (/key/generate, ...) is off; keys can still be made "
              "with `treeserve gateway keys create`", file=sys.stderr)
    for model in config.models.values():
        print(f"model {model.name}: {', '.join(b.name for b in model.backends)}", file=sys.stderr)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = Store(configured_url(config.database))
    store.db.reach()  # (before serving: in the app's startup, uvicorn printed the error's traceback)
    app = build_app(config, store)
    freeze_startup_heap()  # ~155k objects: a full collection of them was a ~95 ms pause of every relayed stream
    return run_gateway(app, args.host, args.port, sockets=sockets)


def chat_overrides(args) -> dict | None:
    """The chat flags as a `chat:` section (None: the file's, if any, is kept)."""
    if not (args.chat or args.chat_verifier or args.chat_router or args.chat_tool):
        return None
    pairs = {}
    for flag, values in (("--chat-verifier", args.chat_verifier), ("--chat-tool", args.chat_tool)):
        pairs[flag] = {}
        for value in values:
            name, sep, target = value.partition("=")
            if not sep or not name or not target:
                raise ValueError(f"{flag}: expected NAME=VALUE, got {value!r}")
            pairs[flag][name] = target
    return {"enabled": True, "verifiers": pairs["--chat-verifier"], "router_model": args.chat_router,
            "tools": pairs["--chat-tool"]}


def cmd_keys_create(args) -> int:
    fields = {k: getattr(args, k) for k in ("user_id", "key_alias", "max_budget", "soft_budget", "budget_duration",
                                            "rpm_limit", "tpm_limit", "max_parallel_requests")
              if getattr(args, k) is not None}
    token, info = _store(args).accounts.create_key(duration=args.duration, models=_models(args.models), **fields)
    print(json.dumps({"key": token, **info}, indent=2))
    return 0


def cmd_keys_list(args) -> int:
    print(json.dumps(_store(args).accounts.list_keys(args.user_id), indent=2))
    return 0


def cmd_keys_delete(args) -> int:
    print(json.dumps({"deleted_keys": _store(args).accounts.delete_keys(args.keys)}, indent=2))
    return 0


def cmd_users_create(args) -> int:
    """/user/new from the command line: the user and, unless --no-key, a key with the user's models;
    its answer printed (the key shown this once)."""
    from treeserve.gateway.admin import new_user_answer, new_user_key
    from treeserve.gateway.passwords import hash_password

    fields = {k: getattr(args, k) for k in ("max_budget", "budget_duration") if getattr(args, k) is not None}
    if args.models is not None:
        fields["models"] = _models(args.models)
    password = args.password or os.environ.get("TREESERVE_PASSWORD")
    password_hash = hash_password(password) if password else None
    key = new_user_key(fields, args.auto_create_key)
    token, info = _store(args).accounts.create_user_with_key(args.user_id, password_hash, key, **fields)
    print(json.dumps(new_user_answer(token, info), indent=2))
    return 0


def cmd_users_set_password(args) -> int:
    import getpass

    from treeserve.gateway.chat.store import ChatStore

    password = args.password or os.environ.get("TREESERVE_PASSWORD") or getpass.getpass(f"password for {args.user_id}: ")
    store = _store(args)
    ChatStore(store.db, store.accounts).set_password(args.user_id, password)
    print(f"password set for {args.user_id}")
    return 0


def cmd_db_upgrade(args) -> int:
    store = _store(args)
    print(f"database at revision {store.db.revision()}")
    return 0


def cmd_db_downgrade(args) -> int:
    from alembic.util import CommandError

    store = _unmigrated_store(args)
    try:
        store.db.downgrade(args.revision)
    except CommandError as exc:  # (a revision that does not exist: it was Alembic's traceback)
        raise ValueError(f"revision {args.revision!r}: {exc} (give one such as 0001, or -N for N back)") from None
    print(f"database at revision {store.db.revision()}")
    return 0


def main(argv: list[str]) -> int:
    """`treeserve gateway ...` and `treeserve chat` without the engine's imports (see treeserve.cli.main)."""
    from treeserve.gateway.database import DatabaseUnreachable
    from treeserve.gateway.errors import GatewayError
    from treeserve.wire.errors import APIError

    from treeserve.cli_help import Parser

    parser = Parser(prog="treeserve")
    commands = parser.add_subparsers(dest="command", required=True)
    add_gateway_parsers(commands)
    args = parser.parse_args(argv)
    ignored = serving_options_given(commands.choices["gateway"], args) if getattr(args, "gateway_command", None) else []
    if ignored:
        print(f"error: {', '.join(ignored)}: options of the serving gateway; `treeserve gateway "
              f"{args.gateway_command}` reads none of them (--database says where the keys and users are)",
              file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (APIError, GatewayError) as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except DatabaseUnreachable as exc:
        print(f"error: {exc}; check --database or TREESERVE_GATEWAY_DATABASE", file=sys.stderr)
        return 2
