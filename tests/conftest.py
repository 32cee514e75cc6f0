import contextlib
import os
import tempfile
from pathlib import Path

# `make test` runs the suite in two pytest-xdist workers: each worker, and every command it
# starts, gets its share of the cores, set before torch is imported (two torch processes spinning on
# every core each make small ops many times slower).
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
THREADS = max(1, CORES // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors under Triton's interpreter, which is read when a kernel
    # module is first imported (only the Triton attention backend's tests import one).
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Argon2id at 1 MiB, one pass, in this process and every command the tests start (gateway/passwords.py;
# test_weak_password_hashes_only_where_asked checks the default): ~0.15 s a hash otherwise, several per
# chat test.
os.environ.setdefault("TREESERVE_INSECURE_FAST_PASSWORD_HASHES", "1")

from treeserve.testing.tiny_models import FAMILIES, make_tiny_model

from gateway_support import database, postgres, rabbitmq  # noqa: F401  (fixtures: a gateway's database
# on SQLite and PostgreSQL, a PostgreSQL cluster, a RabbitMQ node)
# the CI=true rules (a missing component or a needless skip fails the run), as hooks of this conftest
from ci_strict import pytest_make_collect_report, pytest_runtest_makereport, pytest_sessionstart  # noqa: F401

torch.set_num_threads(min(2, THREADS))

# The heaviest files, heaviest first (seconds of a `make test` run on 2 cores, session 84), handed out
# before the rest so that the last files to run are short ones and both workers finish together
# (`make test` passes --no-loadscope-reorder: xdist would otherwise order files by their number of
# tests, and a one-test file of two minutes would start last). Files not named here run after these,
# in name order: remeasure (`pytest --durations=0`, summed per file) when a file grows past ~12 s.
HEAVY_FILES = ("test_readme.py", "test_tensor_parallel.py", "test_gateway_schemathesis.py",  # 65-140 s
               "test_lifecycle.py", "test_gateway_batches.py", "test_bundled_models.py", "test_gateway.py",
               "test_triton_parity.py", "test_chat_browser.py", "test_tensor_parallel_faults.py",  # 40-55 s
               "test_gpu_benchmark.py", "test_gateway_store.py", "test_server_tool_calls.py",
               "test_schemathesis.py", "test_chat_restart.py", "test_chat_api.py", "test_gateway_heartbeat.py",
               "test_train_script.py", "test_rolling_restart.py", "test_memory_split_benchmark.py",  # 20-35 s
               "test_tensor_parallel_ray.py", "test_drain.py", "test_broker_connection.py", "test_lm_eval.py",
               "test_quantized_tensor_parallel.py", "test_gateway_faults.py", "test_gateway_admin.py",
               "test_spec_decode_draft_model.py", "test_quantized_checkpoints.py", "test_host_step_benchmark.py",
               "test_agent_apis.py", "test_gateway_failover.py", "test_gateway_broker.py", "test_guidellm.py",
               "test_server_structured_outputs.py", "test_triton_kernels.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# The CPU kernels' builds, shared by the suite's processes and runs (a build takes ~9 s on 2 cores, and
# each xdist worker, the timing run and every process given its own cache paid it): a library's folder
# is named by a hash of its sources, flags, compiler and CPU, and is installed whole (atomic rename).
SHARED_KERNELS = Path(tempfile.gettempdir()) / "treeserve-test-kernels"


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("treeserve-cache")
    SHARED_KERNELS.mkdir(exist_ok=True)
    (cache / "kernels").symlink_to(SHARED_KERNELS, target_is_directory=True)
    os.environ["TREESERVE_CACHE"] = str(cache)


@pytest.fixture(scope="module", autouse=True)
def _apps_let_go():
    """After each module, the apps it built are let go of. FastAPI keeps every route's endpoint in
    module-level LRU caches of 4,096 entries (`fastapi.dependencies.models`, which classify callables):
    an app's endpoints close over its engines, so a module's app and its KV arena (1 GiB at the CPU
    default) stayed alive for dozens of modules after it; a worker of the suite then counted them as
    its own memory, and a later default KV budget found none left ("no memory is left for KV
    blocks", 62 errors in one CI run). A process that builds one app, as `treeserve serve` does,
    holds nothing extra."""
    yield
    import gc

    from fastapi.dependencies import models

    for name in ("_is_gen_callable_cached", "_is_async_gen_callable_cached", "_is_coroutine_callable_cached"):
        cached = getattr(models, name, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: make_tiny_model(family, root / family, seed=1) for family in FAMILIES}


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """A generator and a PRM of different families and widths, for the served-pair tests. The PRM's
    config.json names its recipe (RLHFlow's), which makes it a verifier (runtime/roles.py)."""
    root = tmp_path_factory.mktemp("served-pair")
    return {"gen": str(make_tiny_model("llama", root / "gen", seed=5)),
            "prm": str(make_tiny_model("qwen2", root / "prm", seed=6, hidden_size=96, prm_recipe="rlhflow"))}


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs):
    return tiny_model_dirs["llama"]


def migrations_head() -> str:
    """The gateway's newest migration (what `Store.migrate()` takes a database to), read from its
    migrations folder so that a new revision does not break the tests that upgrade old schemas."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory
    from treeserve.gateway.database import MIGRATIONS
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(config).get_current_head()


def assert_no_leak(engine):
    """Every block is free (possibly still cached): nothing holds a reference after the workload."""
    pool = engine.kv.pool
    assert not engine.scheduler.has_unfinished()
    assert not engine.kv.block_tables, f"block tables left: {list(engine.kv.block_tables)}"
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert pool.num_free == pool.num_blocks


API_KEY = "sk-test-key"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(app):
    """Runs `app` under a real uvicorn server on a free loopback port; yields its base URL."""
    import threading
    import time

    import uvicorn

    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uv.started, "server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        engine = getattr(app.state, "engine", None)  # a treeserve server's (a gateway has none)
        if engine is not None:
            engine.shutdown()


@pytest.fixture(scope="session")
def server(llama_dir):
    """The tiny Llama served as 'tiny', with an API key."""
    from types import SimpleNamespace

    from treeserve.server.launch import build_app

    app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], max_queue=1000,
                    dtype="float32", device="cpu", kv_cache_memory_bytes=32 << 20, max_model_len=512)
    with running_server(app) as url:
        yield SimpleNamespace(url=url, app=app, async_engine=app.state.engine, engine=app.state.engine.engine,
                              key=API_KEY)


@pytest.fixture(scope="module")
def bundled_pair_served():
    """The bundled pair (generator 'gen', verifier 'prm') served: (base URL, app)."""
    from treeserve.server.launch import build_app

    app = build_app({"gen": "builtin:arith-gen", "prm": "builtin:arith-prm"}, dtype="float32", device="cpu")
    with running_server(app) as url:
        yield url, app


def wait_all_idle(app) -> None:
    """Every engine of a served app idle, none with work left."""
    for engine in app.state.engine.engines.values():
        wait_idle(engine)
        assert not engine.scheduler.has_unfinished()


def wait_idle(engine, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while (engine.scheduler.has_unfinished() or engine.groups) and time.monotonic() < deadline:
        time.sleep(0.02)
