"""Under `CI=true` the suite may not quietly test less (issue #40): a component the tests need that
is missing (PostgreSQL, RabbitMQ, Chromium and its driver, a C compiler, a package of the `[test]`
extra) fails the run at its start, naming it, and a test that skips for any reason but the
hardware this machine lacks (a CUDA device, the CPU's bf16 units) fails instead. Everywhere, the
run ends with why each skipped test skipped (`-rs` in pyproject.toml).

A skip allowed under CI says so by starting its reason with `HARDWARE`. The hooks below are
tests/conftest.py's (imported there); `pytest -p ci_strict` loads them alone (tests/test_ci_strict.py)."""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil
from pathlib import Path

import pytest

HARDWARE = "hardware:"  # the prefix of a skip reason CI allows: the machine lacks the device or unit
TEST_PACKAGES = {"xdist": "pytest-xdist", "triton": "triton", "ray": "ray", "openai": "openai",
                 "lm_eval": "lm_eval[hf]", "tenacity": "tenacity", "jsonschema": "jsonschema",
                 "schemathesis": "schemathesis", "selenium": "selenium", "compressed_tensors": "compressed-tensors"}


def strict() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def missing_components() -> list[str]:
    """What the suite needs that this machine lacks, each named with where it comes from."""
    missing = []
    if not (shutil.which("initdb") or glob.glob("/usr/lib/postgresql/*/bin/initdb")):
        missing.append("PostgreSQL (Debian's postgresql: initdb, pg_ctl)")
    if not (Path("/usr/lib/rabbitmq/bin/rabbitmq-server").exists() or shutil.which("rabbitmq-server")):
        missing.append("RabbitMQ (Debian's rabbitmq-server)")
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        missing.append("Chromium (Debian's chromium)")
    if not (shutil.which("chromedriver") or Path("/usr/bin/chromedriver").exists()):
        missing.append("chromedriver (Debian's chromium-driver)")
    if not (shutil.which("cc") or shutil.which("gcc")):
        missing.append("a C compiler (Debian's gcc), for treeserve's CPU kernels")
    missing += [f"the Python package {spec} (pip install -e '.[test]')" for module, spec in TEST_PACKAGES.items()
                if importlib.util.find_spec(module) is None]
    return missing


def allowed_skip(reason: str) -> bool:
    return reason.removeprefix("Skipped: ").startswith(HARDWARE)


def skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def pytest_sessionstart(session):
    """Under CI=true a missing component fails the run now, named."""
    missing = missing_components() if strict() else []
    if missing:
        pytest.exit("CI=true: the test suite needs what this machine lacks: " + "; ".join(missing)
                    + " (`make test` installs them where apt-get and the package index can be reached)", returncode=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _refuse_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _refuse_skip(outcome.get_result())


def _refuse_skip(report) -> None:
    """Under CI=true only what the hardware rules out may skip; any other skip fails, with its reason."""
    if strict() and report.skipped and not hasattr(report, "wasxfail") and not allowed_skip(skip_reason(report)):
        reason = skip_reason(report)
        report.outcome = "failed"
        report.longrepr = f"CI=true: only what this machine's hardware rules out may skip; this skipped: {reason}"
