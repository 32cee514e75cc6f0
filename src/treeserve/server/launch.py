"""`treeserve serve`: build the engine, the async loop, the app, and run uvicorn."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from starlette.middleware.cors import CORSMiddleware

from treeserve.config import EngineConfig
from treeserve.lifecycle import freeze_startup_heap, start_cut_short_by_signals
from treeserve.model.registry import DEFAULT_PAIR, given_name, named_models, served_name
from treeserve.ports import ready_to_serve
from treeserve.engine.async_engine import AsyncLLMEngine
from treeserve.engine.engine_loop import EngineLoop
from treeserve.engine.llm_engine import LLMEngine
from treeserve.server.app import create_app
from treeserve.wire.drain import Drain, DrainingServer, uvicorn_config
from treeserve.runtime.roles import is_generator, verifier_recipe
from treeserve.runtime.runtime import Runtime
from treeserve.runtime.scorer import StepScorer
from treeserve.search.runner import SearchRunner
from treeserve.server import request_log
from treeserve.server.metrics import ServerMetrics
from treeserve.server.serving_search import SearchServing
from treeserve.server.stats_log import StatsLog, log_stats_interval
from treeserve.server.tool_calls import ToolSettings
from treeserve.entrypoints.chat_utils import load_chat_template, warn_replaced_tool_templates

def build_app(model: str | dict[str, str], served_model_name: str | None = None, api_keys: list[str] | None = None,
              max_queue: int | None = None, kv_mode: str = "shared", max_problems_in_flight: int = 32,
              engine_thread: bool = True, chat_template: str | None = None, tool_settings: ToolSettings | None = None,
              drain: Drain | None = None, verifiers: dict[str, str | None] | None = None,
              request_id_headers: bool = False, trust_request_chat_template: bool = False, **engine_options):
    """One model (a path, served as `served_model_name` or `served_name(path)`; or one name -> path)
    gets its own engine; several (name -> path) share a `Runtime`. Verifiers (/v1/rewards, a search's `verifier`) are the models with a
    reward head or a recipe declared in their config.json, and those `verifiers` names (name ->
    recipe, or None: its declared one, else RLHFlow's); runtime/roles.py says why. One engine loop
    steps them all; each served generator gets a search runner whose problems, from every request,
    advance together. With `engine_thread=False` the caller runs the loop
    (`app.state.engine.run_forever()`)."""
    _check_served_model_name(served_model_name)
    metrics = ServerMetrics()
    scorers, loop, verifiers, runtime = {}, None, dict(verifiers or {}), None
    if isinstance(model, dict) and len(model) > 1:
        _check_verifiers_served(verifiers, list(model))
        budget = engine_options.pop("kv_cache_memory_bytes", None)
        runtime = Runtime(model, kv_mode=kv_mode, kv_cache_memory_bytes=budget, recipes=verifiers, **engine_options)
        served, loop = dict(runtime.engines), runtime.loop
        scorers = {name: runtime.scorer(name) for name in runtime.recipes}
        for name, row in runtime.memory.items():
            metrics.add_model(served[name], name).set_memory(row)
    else:
        name, path = next(iter(model.items())) if isinstance(model, dict) else (served_name(model), model)
        name = served_model_name or name
        _check_verifiers_served(verifiers, [name])
        served = {name: LLMEngine.from_config(EngineConfig(model=path, **engine_options))}
        loop = EngineLoop(served)  # the one loop that steps this engine
        metrics.add_model(served[name], name)
        recipe = verifier_recipe(served[name].model_dir, name in verifiers, verifiers.get(name))
        if recipe is not None:
            scorers = {name: StepScorer(served[name], recipe, loop=loop)}
    async_engine = AsyncLLMEngine(served, max_queue=max_queue, on_step=metrics.on_step, on_abort=metrics.on_abort,
                                  loop=loop, start_thread=engine_thread, on_idle=metrics.on_idle)
    searches = {name: SearchServing(async_engine, name, SearchRunner(engine, None, max_problems_in_flight,
                                                                     loop=async_engine.loop), scorers)
                for name, engine in served.items() if is_generator(engine.model_config)}
    metrics.add_search(searches, scorers)
    app = create_app(async_engine, served, api_keys=api_keys, metrics=metrics, searches=searches,
                     chat_template=chat_template, tool_settings=tool_settings, drain=drain, scorers=scorers,
                     request_id_headers=request_id_headers, trust_request_chat_template=trust_request_chat_template)
    app.state.runtime = runtime  # (a Runtime let go of closes its engines: the app holds it while it serves them)
    return app


def _check_served_model_name(name: str | None) -> None:
    """(an empty name was taken as none given: the model was served under its path's name)"""
    from treeserve.errors import ParamError

    if name is not None and not name.strip():
        raise ParamError("served_model_name", f"is empty ({name!r}): give the name requests call the model by, "
                         "or None for the model's own")


def _check_verifiers_served(verifiers: dict, names: list[str]) -> None:
    for name in verifiers:
        if name not in names:
            raise ValueError(f"--verifier {name}: no served model has that name (served: {', '.join(names)})")


def served_verifiers(values: list[str] | None) -> dict[str, str | None]:
    """`--verifier NAME[=RECIPE]` (repeatable): the served models read as process reward models,
    each by RECIPE, or by its declared recipe, else RLHFlow's."""
    from treeserve.runtime.prm_recipes import RECIPES

    verifiers: dict[str, str | None] = {}
    for value in values or []:
        name, _, recipe = value.partition("=")
        if recipe and recipe not in RECIPES:
            raise ValueError(f"--verifier {value}: unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
        verifiers[name] = recipe or None
    return verifiers


def api_keys(args) -> list[str]:
    """--api-key's keys, else TREESERVE_API_KEY's. A blank one is refused: it was dropped, and a
    server given only `--api-key "$KEY"` with KEY unset started open to anyone, without a word; a key
    with spaces at either end could never be sent (a presented key is stripped)."""
    from treeserve.errors import ParamError

    keys = list(args.api_key or [])
    for key in keys:
        if not key.strip():
            raise ParamError("--api-key", "a blank key would leave every route open; give the key, or no --api-key "
                             "for a server without one")
        if key != key.strip():
            raise ParamError("--api-key", "a key cannot start or end with spaces (no client could send it)")
    if not keys and os.environ.get("TREESERVE_API_KEY"):
        keys = [os.environ["TREESERVE_API_KEY"]]
    return keys


def app_from_args(args):
    """The app `treeserve serve` (and `treeserve worker`) builds from its command line."""
    keys = api_keys(args)
    chat_template = load_chat_template(args.chat_template)
    tool_settings = ToolSettings(args.tool_call_parser, args.enable_auto_tool_choice)
    app = build_app(served_target(args), served_model_name=args.served_model_name, api_keys=keys, kv_mode=args.kv_mode,
                    max_queue=args.max_queue, max_problems_in_flight=args.max_problems_in_flight,
                    dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    kv_cache_memory_bytes=args.kv_cache_memory_bytes, block_size=args.block_size,
                    gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
                    enable_prefix_caching=args.enable_prefix_caching, attention_backend=args.attention_backend,
                    enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                    quantization=args.quantization, speculative_config=args.speculative_config,
                    load_format=args.load_format, tensor_parallel_size=args.tensor_parallel_size,
                    distributed_executor_backend=args.distributed_executor_backend,
                    threads_per_rank=args.threads_per_rank, engine_thread=False,
                    chat_template=chat_template, tool_settings=tool_settings, drain=Drain(args.shutdown_timeout),
                    verifiers=served_verifiers(getattr(args, "verifier", None)),
                    request_id_headers=getattr(args, "enable_request_id_headers", False),
                    trust_request_chat_template=getattr(args, "trust_request_chat_template", False))
    tokenizers = {name: engine.tokenizer for name, engine in app.state.engine.engines.items()}
    warn_replaced_tool_templates(tokenizers, chat_template, args.chat_template)
    allow_cors(app, args)
    return app


# the answers' headers a page may read: the request's id (Anthropic's `request-id` on its routes,
# `X-Request-Id` with --enable-request-id-headers), which the clients show as `_request_id`
EXPOSED_HEADERS = ["request-id", "x-request-id"]


def allow_cors(app, args) -> None:
    """CORS headers for the origins `--allowed-origins` names (none by default); added last, so the
    outermost: a browser's preflight (OPTIONS, no key) is answered before the key is asked for."""
    origins = getattr(args, "allowed_origins", None)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=args.allowed_methods,
                           allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                           expose_headers=EXPOSED_HEADERS)


def served_target(args) -> str | dict[str, str]:
    """What the command line serves: the positional model, the --model NAME=PATH ones, or the bundled
    pair. A ValueError for flags that would be dropped: a positional model and --model together, and
    --served-model-name with several models (each is named by its --model NAME=PATH)."""
    if args.model_path and args.model:
        raise ValueError(f"give the model either as the argument ({args.model_path}) or with --model, not both")
    target = args.model_path or (named_models(args.model) if args.model else DEFAULT_PAIR)
    if args.served_model_name and isinstance(target, dict) and len(target) > 1:
        raise ValueError(f"--served-model-name names one model, and {len(target)} are served "
                         f"({', '.join(target)}); name each with --model NAME=PATH")
    if args.served_model_name and args.model and given_name(args.model[0]) is not None:
        (name,) = target
        if name != args.served_model_name:
            raise ValueError(f"the model is named twice: {name!r} by --model {name}=PATH and "
                             f"{args.served_model_name!r} by --served-model-name; give one name")
    return target


def _logged_app(args):
    """The app, with logging set up and the startup heap frozen; None (the error logged) when the
    command line is wrong. A signal while it starts exits 128 + its number (the start cut short)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with start_cut_short_by_signals():
        try:
            if not getattr(args, "disable_log_stats", False):
                log_stats_interval()  # (a bad value said before the models load)
            app = app_from_args(args)
        except ValueError as exc:  # (a bad --shutdown-timeout too)
            logging.getLogger(__name__).error("%s", exc)
            return None
        freeze_startup_heap()
    return app


def serve(args) -> int:
    from treeserve.ports import PortUnavailableError, bind_sockets, closing_all

    try:  # before the models load: a taken port is said at once, and held while they load (vLLM's way)
        sockets = bind_sockets(args.host, args.port, "--port")
    except PortUnavailableError as error:
        print(f"treeserve serve: {error}", file=sys.stderr)
        return 2
    with closing_all(sockets):
        return _serve_on(sockets, args)


def _serve_on(sockets: list, args) -> int:
    """The app loaded and served on `sockets`, the ones bound before it loaded."""
    app = _logged_app(args)
    if app is None:
        return 2
    config = uvicorn_config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log)
    server = DrainingServer(config, app.state.drain, name="treeserve serve")
    request_log.enable(args.enable_log_requests)
    _log_stats(app, args)
    run_engine_on_main_thread(app.state.engine, server, server.handle_exit, sockets=sockets)
    return _exit_status(app, server)


def worker(args) -> int:
    """`treeserve worker --broker URL`: the app on a loopback port, fed by the broker's queues. The
    first SIGTERM or SIGINT drains: nothing more is taken from the queues, what is in hand is
    answered (for up to --shutdown-timeout seconds; then given back to the queue, or a stream under
    way ended with an error); a second signal does that at once."""
    import uvicorn

    from treeserve.ports import bind_sockets
    from treeserve.server.broker_worker import BrokerWorker

    app = _logged_app(args)
    if app is None:
        return 2
    sockets = bind_sockets("127.0.0.1", 0, "a loopback port")  # (held: no one takes it before uvicorn serves)
    port = sockets[0].getsockname()[1]
    # (its requests are the consumer's, which has waited out the grace already: uvicorn's own is short)
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, log_level="warning"))
    keys = api_keys(args)
    consumer = BrokerWorker(args.broker, f"http://127.0.0.1:{port}", list(app.state.served_models),
                            prefetch=args.prefetch, api_key=keys[0] if keys else None)

    def start_consumer() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            consumer.start()

    def on_signal(signum, frame) -> None:
        first = consumer.stop(grace=args.shutdown_timeout)
        log = logging.getLogger(__name__)
        if first and consumer.ready.is_set():
            log.info("%s: draining the requests in hand for up to %g s (another signal stops now)",
                     signal.Signals(signum).name, args.shutdown_timeout)
        else:
            consumer.stop(grace=0)
            server.should_exit = True

    threading.Thread(target=start_consumer, name="treeserve-broker-start", daemon=True).start()
    _log_stats(app, args)
    run_engine_on_main_thread(app.state.engine, server, on_signal, sockets=sockets,
                              also_stop=lambda: consumer.error is not None or consumer.finished.is_set())
    consumer.stop(grace=0)
    if consumer.error is not None:
        logging.getLogger(__name__).error("the broker connection failed (%s); the worker stopped", consumer.error)
        return 1
    return _exit_status(app, server)


def _log_stats(app, args) -> None:
    """vLLM's periodic stats line (server/stats_log.py), unless --disable-log-stats."""
    if not args.disable_log_stats:
        StatsLog(app.state.metrics).start()


def _exit_status(app, server) -> int:
    if not server.started:  # uvicorn could not start (a port in use, say): it logged why
        logging.getLogger(__name__).error("the HTTP server did not start; see the errors above")
        return 1
    if app.state.engine.errored is not None:  # the loop failed and took HTTP down: a supervisor restarts us
        logging.getLogger(__name__).error("the engine loop failed (%s); the server stopped", app.state.engine.errored)
        return 1
    return 0


def run_engine_on_main_thread(engine, server, on_signal, also_stop=lambda: False, sockets=None) -> None:
    """HTTP on a background thread (on `sockets` if given, bound already), the engine loop on this (the
    main) thread, where PyTorch's thread pool runs small ops fastest (see engine/async_engine.py).
    SIGINT and SIGTERM go to `on_signal` (a drain: the HTTP server ends when its requests have); the
    loop ends with the HTTP server, or when `also_stop()`."""
    sockets = ready_to_serve(sockets) if sockets is not None else None
    http = threading.Thread(target=server.run, kwargs={"sockets": sockets}, name="treeserve-http", daemon=True)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    http.start()
    try:
        engine.run_forever(should_stop=lambda: not http.is_alive() or also_stop())
    finally:
        server.should_exit = True
        http.join(timeout=15)
        engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
