"""The API fuzzed from its own OpenAPI schema (schemathesis): no server error, and every response
within the schema, over hundreds of generated requests."""
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is a test dependency: pip install -e '.[test]'")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis import checks as st_checks  # noqa: E402

from conftest import API_KEY  # noqa: E402

EXAMPLES = 100  # per operation (11 operations; the simple ones have fewer distinct cases)
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def fuzzed_app(tmp_path_factory):
    from treeserve.model.random_models import make_tiny_model
    from treeserve.server.launch import build_app

    path = make_tiny_model("llama", tmp_path_factory.mktemp("fuzz") / "m", seed=3, max_position_embeddings=96)
    app = build_app(str(path), served_model_name="tiny", api_keys=[API_KEY], max_queue=64, dtype="float32",
                    device="cpu", kv_cache_memory_bytes=8 << 20, max_model_len=96)
    yield app
    app.state.engine.shutdown()


def test_no_server_error_and_responses_in_the_schema(fuzzed_app):
    """Every operation, EXAMPLES generated requests each (hypothesis strategies from the schema;
    schemathesis' pytest plugin does not load with this pytest)."""
    from hypothesis import given

    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app, headers=HEADERS)
    calls, server_errors = 0, []
    checks = [st_checks.not_a_server_error, st_checks.status_code_conformance, st_checks.content_type_conformance,
              st_checks.response_schema_conformance]
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)
        def fuzz(case):
            nonlocal calls
            response = case.call(headers=HEADERS)
            calls += 1
            if response.status_code >= 500:
                server_errors.append((operation.label, response.status_code, response.text[:200]))
            case.validate_response(response, checks=checks)
        fuzz()
    print(f"schemathesis: {calls} generated requests, {len(server_errors)} server errors")
    assert not server_errors, server_errors
    assert calls >= 500, calls
