"""`treeserve chat`: the web chat on the bundled models in one command. Starts `treeserve serve`
(arith-gen, its PRM arith-prm and the tool router arith-router, with the hermes tool-call parser)
as a child process, puts the gateway with its chat page in front of it (tools mode routed by
arith-router), and prints the URL and a first user's name and password (a new password each start)."""
from __future__ import annotations

import os
import secrets
import string
import subprocess
import sys
import threading

from treeserve.arg_types import database_url, given, port
from treeserve.lifecycle import child_env

GENERATOR, VERIFIER, ROUTER = "arith-gen", "arith-prm", "arith-router"
# What the bundled models answer well, offered by the empty conversation (tests/test_chat_examples.py
# checks each greedily and by a beam search; sampled at the chat's temperature 0.7 the chat one was right
# 40 times in 40, and beam searches of 4 found the search one 10 times in 10; the tools one goes to
# SymPy through the bundled router).
EXAMPLES = [
    {"mode": "chat", "text": "Start with 40 and work modulo 100. Step 1: - 5. Step 2: + 9. What is the result?"},
    {"mode": "search", "text": "Start with 21 and work modulo 100. Step 1: + 6. Step 2: * 3. Step 3: - 8. "
                               "Step 4: + 5. What is the result?"},
    {"mode": "tools", "text": "What is 17 * 23 + 5?"},
]


def add_chat_parser(sub) -> None:
    chat = sub.add_parser("chat", help="the web chat on the bundled models: a server, the gateway and a first user")
    chat.add_argument("--host", default="127.0.0.1", help="the chat page's address")
    chat.add_argument("--port", type=port, default=4000, help="the chat page's (the gateway's) port")
    chat.add_argument("--serve-port", type=port, help="the model server's port on 127.0.0.1 (default: a free one)")
    chat.add_argument("--database", type=database_url, help="the gateway's database URL (default: "
                      "TREESERVE_GATEWAY_DATABASE, else ./treeserve-gateway.db, as for `treeserve gateway`)")
    chat.add_argument("--user", default="demo", type=given("give the first user's name"), help="the first user's name (its password is printed)")
    chat.add_argument("--master-key", help="the admin API's key (/key/generate, /user/new, /spend/logs ...); default "
                      "TREESERVE_MASTER_KEY, else a new one printed at each start")
    chat.add_argument("--chat-tool", action="append", default=[], metavar="NAME=URL",
                      help="an HTTP tool for tools mode: weather=URL or wikipedia=URL")
    chat.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="on SIGTERM or SIGINT, seconds the answers under way may take to finish (the gateway's "
                      "and then the server's); a second signal exits at once")
    chat.set_defaults(func=cmd_chat)


def first_user(store, user_id: str) -> str:
    """The user made (or its password renewed) with a fresh random password, which is returned."""
    from treeserve.gateway.chat.store import ChatStore
    from treeserve.gateway.errors import UserExists
    from treeserve.gateway.passwords import hash_password

    password = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(16))
    try:
        store.accounts.create_user(user_id, password_hash=hash_password(password))
    except UserExists:  # there from an earlier start: a new password
        ChatStore(store.db, store.accounts).set_password(user_id, password)
    return password


def cmd_chat(args) -> int:
    from treeserve.ports import PortUnavailableError, bind_sockets, closing_all, ensure_port_free, free_port

    try:  # the chat page's port, held while the model server starts (that server binds its own)
        sockets = bind_sockets(args.host, args.port, "--port")
    except PortUnavailableError as error:
        print(f"treeserve chat: {error}", file=sys.stderr)
        return 2
    with closing_all(sockets):
        try:
            serve_port = args.serve_port or free_port()
            if args.serve_port:
                ensure_port_free("127.0.0.1", serve_port, "--serve-port")
        except PortUnavailableError as error:
            print(f"treeserve chat: {error}", file=sys.stderr)
            return 2
        return _chat_on(sockets, serve_port, args)


def _chat_on(sockets: list, serve_port: int, args) -> int:
    """The model server started on `serve_port`, and the gateway in front of it on `sockets`."""
    from treeserve.model.registry import CHAT_MODELS, CHAT_TOOL_PARSER

    url = f"http://127.0.0.1:{serve_port}"
    # the gateway's settings and its database first: a wrong one is said at once, not after the models load
    config, given = _gateway_config(args, url)
    password = _first_user_in(config.database, args.user)
    models = [f"--model={name}={path}" for name, path in CHAT_MODELS.items()]
    server = subprocess.Popen([sys.executable, "-m", "treeserve.cli", "serve", "--port", str(serve_port), *models,
                               "--tool-call-parser", CHAT_TOOL_PARSER, "--shutdown-timeout", str(args.shutdown_timeout)],
                              env=child_env())
    app = None
    try:
        # (imported while the server starts)
        from treeserve.bench.health import wait_healthy
        from treeserve.gateway.app import build_app
        from treeserve.gateway.launch import run_gateway

        print(f"starting the model server ({', '.join(CHAT_MODELS)}) at {url} ...", file=sys.stderr, flush=True)
        try:
            wait_healthy(url, server, timeout=900, models=CHAT_MODELS)
        except RuntimeError as error:  # its own error is in its log above
            print(f"treeserve chat: the model server did not start: {error}", file=sys.stderr)
            return 1
        print(_banner(args, config.database, password, config.master_key, shown=not given), flush=True)
        app = build_app(config)
        died = threading.Event()
        code = run_gateway(app, args.host, args.port, sockets=sockets,
                           watch=lambda gateway: _watch(server, gateway, died))
        return 1 if died.is_set() else code
    finally:
        _stop_server(server, args.shutdown_timeout, now=app is not None and app.state.drain.forced)


def _gateway_config(args, url: str):
    """The gateway's config in front of the model server at `url` (its database as every gateway command
    finds it), and whether the master key was given (by flag or environment) rather than made here."""
    from treeserve.gateway.config_load import build_config
    from treeserve.gateway.database import configured_url
    from treeserve.model.registry import CHAT_MODELS

    given = args.master_key or os.environ.get("TREESERVE_MASTER_KEY")
    master_key = given or "sk-admin-" + secrets.token_urlsafe(24)
    tools = dict(value.partition("=")[::2] for value in args.chat_tool)
    config = build_config([f"{name}={url}" for name in CHAT_MODELS], None, database=configured_url(args.database),
                          master_key=master_key,
                          chat={"enabled": True, "verifiers": {GENERATOR: VERIFIER}, "router_model": ROUTER,
                                "router_history": False, "tools": tools, "examples": {GENERATOR: EXAMPLES}},
                          shutdown_timeout=args.shutdown_timeout)
    return config, bool(given)


def _first_user_in(database: str, user_id: str) -> str:
    """The first user made (or its password renewed) in `database`, brought to the newest schema; its password."""
    from treeserve.gateway.store import Store

    store = Store(database)
    try:
        store.db.reach()  # (one not reached: DatabaseUnreachable, said in one line as by every gateway command)
        store.migrate()
        return first_user(store, user_id)
    finally:
        store.close()


def _banner(args, database: str, password: str, master_key: str, shown: bool) -> str:
    """What a first user needs: the page, the sign-in, and the admin API's key (printed only when it
    was made here: one given by flag or environment is the caller's already); the database as an
    error would name it (a file's path; a server's URL without its password)."""
    from treeserve.gateway.database import shown_url

    where = shown_url(database)
    admin = (f"  admin key: {master_key}  (the admin API at http://{args.host}:{args.port}: /key/generate, "
             "/user/new, /spend/logs; new at each start unless --master-key or TREESERVE_MASTER_KEY)\n"
             if shown else "  admin key: the one given (--master-key or TREESERVE_MASTER_KEY)\n")
    return (f"\n  treeserve chat: http://{args.host}:{args.port}/chat\n  user: {args.user}\n  password: {password}\n"
            f"{admin}  (history kept in {where}; a new password is made at each start)\n")


def _watch(server: subprocess.Popen, gateway, died: threading.Event) -> None:
    """When the model server dies (not stopped by this command), the gateway stops and the command
    exits 1: a chat whose models are gone is restarted by its service manager, not kept answering 503."""
    def wait() -> None:
        code = server.wait()
        if gateway.should_exit or gateway.drain.draining:
            return  # (stopping: a Ctrl-C reached the server too)
        print(f"treeserve chat: the model server (pid {server.pid}) exited with status {code}; stopping the "
              "gateway and exiting 1 (a service manager restarts it)", file=sys.stderr, flush=True)
        died.set()
        gateway.should_exit = True
    threading.Thread(target=wait, name="model-server-watch", daemon=True).start()


def _stop_server(server: subprocess.Popen, timeout: float, now: bool) -> None:
    """SIGTERM: the server drains what the gateway left it (nothing, after the gateway's own drain);
    `now` (a second signal came): SIGKILL, as its own second signal would."""
    if now:
        server.kill()
    else:
        server.terminate()
    try:
        server.wait(timeout + 15)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
