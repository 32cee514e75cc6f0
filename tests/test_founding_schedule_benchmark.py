"""`benchmarks/founding_schedule.py`'s arguments (the replica run itself takes minutes: not here)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import founding_schedule  # noqa: E402
import gpu  # noqa: E402


def test_an_only_that_names_no_configuration_is_refused_before_the_models_are_made(monkeypatch, tmp_path, capsys):
    """A misspelt --only ('static' for 'static gen=0.3') made the models, then timed nothing, silently."""
    def made(*args, **kwargs):
        raise AssertionError("the replica's models were made for a run that times nothing")
    monkeypatch.setattr(gpu, "model_dirs", made)
    with pytest.raises(SystemExit) as exit_:
        founding_schedule.main(["--out", str(tmp_path), "--only", "static"])
    assert exit_.value.code == 2
    assert "'static gen=0.3', 'shared'" in capsys.readouterr().err
