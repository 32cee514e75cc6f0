"""The server at two tensor-parallel ranks: the OpenAI conformance tests of test_server_openai run
against it unchanged (faults: test_tensor_parallel_faults.py)."""
import pytest

from conftest import API_KEY, running_server
from test_server_openai import *  # noqa: F401,F403  (the conformance tests, run here against two ranks)

TP_OPTIONS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=32 << 20, max_model_len=512,
                  tensor_parallel_size=2, threads_per_rank=1)


@pytest.fixture(scope="module")
def server(llama_dir):
    """The tiny Llama served as 'tiny' over two ranks (this process and one worker)."""
    from types import SimpleNamespace

    from treeserve.server.launch import build_app

    app = build_app(str(llama_dir), served_model_name="tiny", api_keys=[API_KEY], max_queue=1000, **TP_OPTIONS)
    engine = app.state.engine.engine
    try:
        with running_server(app) as url:
            yield SimpleNamespace(url=url, app=app, async_engine=app.state.engine, engine=engine, key=API_KEY)
    finally:
        engine.close()
