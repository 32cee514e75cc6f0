"""Under CI=true the suite cannot quietly test less (tests/ci_strict.py): a test that skips for
anything but missing hardware fails with its reason, and a missing component (here, a package of the
test extra) fails the run at its start, naming it. Without CI the same skips are skips, reasons
printed. Each run is a real pytest process with the rules loaded as a plugin."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SKIPPING = '''import pytest


def test_needs_a_widget():
    pytest.skip("the widget is not installed")


def test_needs_a_gpu():
    pytest.skip("hardware: no CUDA device")


def test_runs():
    pass
'''
MISSING_PACKAGE = '''import ci_strict

ci_strict.TEST_PACKAGES["no_such_package_for_treeserve"] = "no-such-package (the test extra)"
'''


def _pytest(tmp_path: Path, ci: bool, *plugins: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(tmp_path)]),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # only the rules: no installed plugin's start-up cost
    env.pop("CI", None)
    if ci:
        env["CI"] = "true"
    args = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "ci_strict"]
    for plugin in plugins:
        args += ["-p", plugin]
    return subprocess.run([*args, "test_skipping.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def test_under_ci_only_hardware_may_skip(tmp_path):
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # this directory is the run's root
    strict = _pytest(tmp_path, ci=True)
    assert strict.returncode == 1, strict.stdout
    assert "1 failed, 1 passed, 1 skipped" in strict.stdout, strict.stdout
    assert "CI=true: only what this machine's hardware rules out may skip" in strict.stdout
    assert "the widget is not installed" in strict.stdout and "hardware: no CUDA device" in strict.stdout
    relaxed = _pytest(tmp_path, ci=False)
    assert relaxed.returncode == 0, relaxed.stdout
    assert "1 passed, 2 skipped" in relaxed.stdout
    assert "SKIPPED [1] test_skipping.py:5: the widget is not installed" in relaxed.stdout  # -rs: reasons shown


def test_under_ci_a_missing_component_fails_the_run_naming_it(tmp_path):
    (tmp_path / "test_skipping.py").write_text("def test_runs():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "missing_package.py").write_text(MISSING_PACKAGE)
    strict = _pytest(tmp_path, True, "missing_package")
    assert strict.returncode == 1, strict.stdout + strict.stderr
    output = strict.stdout + strict.stderr
    assert "CI=true: the test suite needs what this machine lacks" in output
    assert "the Python package no-such-package (the test extra)" in output
    assert "passed" not in strict.stdout
    assert _pytest(tmp_path, False, "missing_package").returncode == 0
