"""`treeserve eval` and `treeserve search` on tiny models: artefacts, summary fields, printed answer."""
import json

import pytest

from treeserve.cli import main
from treeserve.testing.tiny_models import make_tiny_model

ROWS = [{"problem": "What is 1 + 1?", "answer": "2", "level": 1, "unique_id": "a"},
        {"problem": "What is 3 * 3?", "answer": "9", "level": 2, "unique_id": "b"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-search")
    gen = make_tiny_model("llama", root / "gen", seed=7, favour_tokens={"\n": 5.4, "<|eos|>": 0.5})
    prm = make_tiny_model("llama", root / "prm", seed=8)
    return ["--generator", str(gen), "--verifier", str(prm), "--dtype", "float32", "--device", "cpu",
            "--max-model-len", "512", "--kv-cache-memory-bytes", str(8 << 20), "--num-iterations", "3",
            "--max-tokens", "16", "--system-prompt", ""]


def test_eval_writes_per_problem_records_summary_and_plot(models, tmp_path):
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out"
    assert main(["eval", "--dataset", str(dataset), "--strategy", "beam", "--n", "4", "--out", str(out), *models]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "beam" and summary["n"] == 4 and summary["num_problems"] == 2
    assert 0.0 <= summary["accuracy"] <= 1.0
    records = [json.loads(line) for line in (out / "beam_n4.jsonl").read_text().splitlines()]
    assert [r["unique_id"] for r in records] == ["a", "b"]
    assert all(len(r["completions"]) == 4 and "weighted@4" in r["preds"] for r in records)
    assert (out / "accuracy.png").stat().st_size > 0


def test_search_prints_the_chosen_answer_with_its_score_and_tree_size(models, capsys):
    assert main(["search", "--strategy", "best_of_n", "--n", "4", *models, "What is 2 + 2?"]) == 0
    printed = capsys.readouterr().out
    assert "--- answer:" in printed and "score:" in printed and "tree size:" in printed


def test_eval_names_a_bad_strategy(models, tmp_path, capsys):
    dataset = tmp_path / "data.jsonl"
    dataset.write_text(json.dumps(ROWS[0]) + "\n")
    assert main(["eval", "--dataset", str(dataset), "--strategy", "bogus", "--out", str(tmp_path), *models]) == 2
    assert "strategy" in capsys.readouterr().err


@pytest.mark.parametrize("flags, said", [(["--limit", "0"], "--limit: must be at least 1, got 0"),
                                         (["--limit", "-1"], "--limit: must be at least 1, got -1"),
                                         (["--n", "4,x"], "--n: expected a whole number, got 'x'")])
def test_eval_refuses_counts_that_mean_nothing(tmp_path, capsys, flags, said):
    """--limit 0 ran every problem (an hours-long MATH-500 run) and -1 all but the last (a helper's finding)."""
    dataset = tmp_path / "data.jsonl"
    dataset.write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(SystemExit) as refused:
        main(["eval", "--dataset", str(dataset), "--out", str(tmp_path / "out"), *flags])
    assert refused.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("content, said", [
    ("", "has no problems"),
    (json.dumps(ROWS[0]) + "\n" + json.dumps({"problem": "x"}) + "\n", "line 2: a row needs the fields problem and "
                                                                       "answer (missing answer)"),
    (json.dumps(ROWS[0]) + "\n{oops\n", "line 2 is not JSON")])
def test_eval_names_the_line_of_a_bad_dataset_before_it_loads_a_model(tmp_path, capsys, content, said):
    dataset = tmp_path / "data.jsonl"
    dataset.write_text(content)
    assert main(["eval", "--dataset", str(dataset), "--out", str(tmp_path / "out"), "--generator", "/nowhere"]) == 2
    assert said in capsys.readouterr().err


def test_eval_with_out_naming_a_file_is_an_error_not_a_traceback(models, tmp_path, capsys):
    dataset, out = tmp_path / "data.jsonl", tmp_path / "taken"
    dataset.write_text(json.dumps(ROWS[0]) + "\n")
    out.write_text("a file")
    assert main(["eval", "--dataset", str(dataset), "--n", "2", "--strategy", "best_of_n", "--out", str(out),
                 *models]) == 2
    assert "error:" in capsys.readouterr().err
