"""`treeserve eval` and `treeserve search` on tiny models: artefacts, summary fields, printed answer."""
import json
import re

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


def test_search_shows_its_progress_as_it_goes(models, capsys):
    """(it printed nothing until the search had ended: minutes on a real model)"""
    assert main(["search", "--strategy", "beam", "--n", "4", *models, "What is 2 + 2?"]) == 0
    err = capsys.readouterr().err
    assert "beam n=4:" in err and re.search(r"best score \d\.\d{4}, \d+ tokens, tree size \d+", err), err


@pytest.mark.parametrize("strategy", ["greedy", "majority"])
def test_a_search_without_a_verifier_prints_no_score(models, capsys, strategy):
    """(it printed `score: 0.0000`, as if the verifier had judged the answer wrong)"""
    assert main(["search", "--strategy", strategy, "--n", "4", *models, "What is 2 + 2?"]) == 0
    printed = capsys.readouterr().out
    assert f"score: none ({strategy} reads no verifier)" in printed and "0.0000" not in printed


def test_eval_records_no_scores_for_a_strategy_without_a_verifier(models, tmp_path):
    """(its JSONL held agg_scores of 0.0, as if the verifier had judged every candidate wrong, while
    /v1/search says null and `treeserve search` prints `score: none`)"""
    dataset, out = tmp_path / "data.jsonl", tmp_path / "out"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main(["eval", "--dataset", str(dataset), "--strategy", "majority,greedy", "--n", "2", "--out", str(out),
                 *models]) == 0
    for name, size in [("majority_n2", 2), ("greedy_n1", 1)]:
        records = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert [r["agg_scores"] for r in records] == [[None] * size] * 2, records
        assert [r["agg_strategy"] for r in records] == [None, None], records
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert [r["strategy"] for r in runs] == ["majority", "greedy"] and (out / "accuracy.png").stat().st_size > 0
    # (no aggregation folded their scores: the summary named the verifier's, `last` here, beside records of null)
    assert [r["config"]["agg_strategy"] for r in runs] == [None, None], runs


def test_eval_reports_no_score_ranked_predictions_for_a_strategy_without_a_verifier(models, tmp_path):
    """(majority and greedy recorded naive@n and weighted@n, ranked by scores of 0.0 the verifier never
    gave: naive@n was the first answer and weighted@n a tie broken by order, reported as accuracies)"""
    dataset, out = tmp_path / "data.jsonl", tmp_path / "out"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main(["eval", "--dataset", str(dataset), "--strategy", "majority,greedy,best_of_n", "--n", "2",
                 "--out", str(out), *models]) == 0
    for name, keys in [("majority_n2", {"maj@1", "maj@2"}), ("greedy_n1", {"maj@1"}),
                       ("best_of_n_n2", {f"{kind}@{n}" for kind in ("naive", "weighted", "maj") for n in (1, 2)})]:
        records = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert all(set(r["preds"]) == keys and set(r["graded"]) == keys for r in records), (name, records)
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert [set(r["accuracy_by_prediction"]) for r in runs[:2]] == [{"maj@1", "maj@2"}, {"maj@1"}]


@pytest.mark.parametrize("command", ["search", "eval"])
def test_search_and_eval_take_search_and_learns_beam_switches(command, tmp_path):
    """(SearchConfig had filter_duplicates, sort_completed and eos_sampling_at_max_depth, /v1/search too,
    but the command line had no flag for them: "unrecognized arguments")"""
    from treeserve.cli import build_parser
    from treeserve.cli_search import _config

    place = ["q"] if command == "search" else ["--dataset", "d.jsonl", "--out", str(tmp_path)]
    switches = ["--filter-duplicates", "--sort-completed", "--eos-sampling-at-max-depth"]
    names = ("filter_duplicates", "sort_completed", "eos_sampling_at_max_depth")
    args = build_parser().parse_args([command, *switches, *place])
    assert [getattr(_config(args, "beam", 4), name) for name in names] == [True] * 3
    args = build_parser().parse_args([command, *place])
    assert [getattr(_config(args, "beam", 4), name) for name in names] == [False] * 3
    args = build_parser().parse_args([command, "--filter-duplicates", "--no-filter-duplicates", *place])
    assert _config(args, "beam", 4).filter_duplicates is False
    if command == "eval":  # (the reference samples to the end at max depth; its summary recorded the switch off)
        args = build_parser().parse_args([command, "--reference", *place])
        assert _config(args, "beam", 4).eos_sampling_at_max_depth is True


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
    (json.dumps(ROWS[0]) + "\n{oops\n", "line 2 is not JSON"),
    (json.dumps({"problem": None, "answer": "1"}) + "\n", "line 1: problem must be a non-empty string, got None"),
    (json.dumps(ROWS[0]) + "\n" + json.dumps({"problem": " \n", "answer": "1"}) + "\n",
     "line 2: problem must be a non-empty string, got ' \\n'")])
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


def test_an_eval_stopped_by_a_signal_keeps_what_finished_and_exits_128_plus_the_signal(models, tmp_path,
                                                                                      monkeypatch):
    """SIGTERM in the second run (its handler raises SystemExit(143)): the first run's records and
    the second's finished problem are written, with a report marking it interrupted (before, every
    record was lost and the exit status was 0)."""
    import treeserve.search.evaluate as evaluate

    records, real = [], evaluate._record

    def record(row, result):
        if len(records) == 3:  # (beam's second problem: what a signal's handler does in the main thread)
            raise SystemExit(143)
        records.append(row)
        return real(row, result)
    monkeypatch.setattr(evaluate, "_record", record)
    dataset, out = tmp_path / "data.jsonl", tmp_path / "out"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(SystemExit) as stopped:
        main(["eval", "--dataset", str(dataset), "--strategy", "best_of_n,beam", "--n", "4", "--out", str(out),
              *models])
    assert stopped.value.code == 143
    assert len((out / "best_of_n_n4.jsonl").read_text().splitlines()) == 2
    assert len((out / "beam_n4.jsonl").read_text().splitlines()) == 1
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert [(r["strategy"], r["num_problems"], r.get("interrupted")) for r in runs] == \
        [("best_of_n", 2, None), ("beam", 1, True)]
    assert "(interrupted)" in (out / "summary.md").read_text()


def test_a_problem_too_long_for_the_model_is_named_by_its_row(models, tmp_path, capsys):
    rows = [ROWS[0], {"problem": "Start with 5. " * 300, "answer": "1", "unique_id": "long"}]
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", "--dataset", str(dataset), "--strategy", "beam", "--n", "4", "--out",
                 str(tmp_path / "out"), *models]) == 2
    assert "problem 2 (long) of the dataset" in capsys.readouterr().err


@pytest.mark.parametrize("question", ["", "  \n"])
def test_an_empty_question_is_refused_before_a_model_loads(capsys, question):
    """(it loaded both models and searched the generator's noise: a thousand tokens of "3 3 3")"""
    with pytest.raises(SystemExit) as refused:
        main(["search", "--generator", "/nowhere", question])
    assert refused.value.code == 2 and "question: the question is empty" in capsys.readouterr().err


def test_a_failing_problem_keeps_the_problems_that_finished_and_their_report(models, tmp_path, capsys,
                                                                          monkeypatch):
    """(the records of the problems that had finished were thrown away with the error, and no report
    was written: a problem failing after hours of an eval lost them all)"""
    from treeserve.search.runner import SearchRunner

    real = SearchRunner.run

    def run(self, questions, config, on_result=None):  # the first problem finishes, then the second fails
        real(self, questions[:1], config, on_result)
        error = ValueError("the prompt is too long")
        error.problem_index = 1
        raise error
    monkeypatch.setattr(SearchRunner, "run", run)
    dataset, out = tmp_path / "data.jsonl", tmp_path / "out"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main(["eval", "--dataset", str(dataset), "--strategy", "beam", "--n", "4", "--out", str(out),
                 *models]) == 2
    assert "problem 2 (b) of the dataset: the prompt is too long" in capsys.readouterr().err
    assert [json.loads(line)["unique_id"] for line in (out / "beam_n4.jsonl").read_text().splitlines()] == ["a"]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["num_problems"], summary["interrupted"]) == (1, True)
    assert "problem 2 (b) of the dataset" in summary["error"]
    assert "(interrupted)" in (out / "summary.md").read_text()


def test_each_record_is_written_as_its_problem_finishes(models, tmp_path, monkeypatch):
    """A process killed part way (SIGKILL, out of memory) keeps the problems that finished: the
    JSONL holds each record once its problem is done, not only when the whole run is."""
    import treeserve.search.evaluate as evaluate

    dataset, out, seen, real = tmp_path / "data.jsonl", tmp_path / "out", [], evaluate._record

    def record(row, result):
        seen.append(len((out / "best_of_n_n4.jsonl").read_text().splitlines()))
        return real(row, result)
    monkeypatch.setattr(evaluate, "_record", record)
    dataset.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main(["eval", "--dataset", str(dataset), "--strategy", "best_of_n", "--n", "4", "--out", str(out),
                 *models]) == 0
    assert seen == [0, 1]
    assert [json.loads(line)["unique_id"] for line in (out / "best_of_n_n4.jsonl").read_text().splitlines()] == \
        ["a", "b"]


@pytest.mark.parametrize("strategy", [",", " , "])
def test_eval_with_no_strategy_is_an_error_naming_it(tmp_path, capsys, strategy):
    """(it loaded both models, ran nothing and wrote an empty report)"""
    dataset = tmp_path / "data.jsonl"
    dataset.write_text(json.dumps(ROWS[0]) + "\n")
    assert main(["eval", "--dataset", str(dataset), "--strategy", strategy, "--out", str(tmp_path / "out"),
                 "--generator", "/nowhere"]) == 2
    assert "strategy: expected strategies such as beam,best_of_n" in capsys.readouterr().err


def test_a_signal_cuts_a_one_shot_command_short_with_128_plus_its_number(tmp_path):
    """search, eval, run, ...: 130 for Ctrl-C, 143 for SIGTERM (the shell's convention: a job that
    was stopped is not one that finished); the servers and bench sweep still end 0."""
    import subprocess
    import sys

    from treeserve.cli import _is_service

    code = ("import os, signal, time; from treeserve.lifecycle import exit_on_signals; "
            "exit_on_signals(service=False); os.kill(os.getpid(), signal.SIG{}); time.sleep(30)")
    for name, status in (("INT", 130), ("TERM", 143)):
        assert subprocess.run([sys.executable, "-c", code.format(name)], timeout=60).returncode == status
    assert _is_service(["serve"]) and _is_service(["bench", "sweep", "x.yaml"]) and _is_service(["chat"])
    assert not _is_service(["eval"]) and not _is_service(["bench", "serve"]) and not _is_service([])


@pytest.mark.parametrize("bar", [True, False])
def test_the_signals_message_starts_on_a_line_of_its_own_after_a_progress_bar(bar):
    """Ctrl-C during eval's progress bar, stderr a pipe or a file: `treeserve: SIGINT: stopping` was
    written on the bar's line, after its counts; a process with no bar shown gets no blank line."""
    import subprocess
    import sys

    code = ("import os, signal, sys, time; from tqdm import tqdm; from treeserve.lifecycle import exit_on_signals; "
            "exit_on_signals(service=False); made = tqdm(total=4, desc='beam n=4', disable={}); made.update(1); "
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(30)").format(not bar)
    stopped = subprocess.run([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, timeout=60)
    assert stopped.returncode == 130, stopped.stderr
    lines = stopped.stderr.split("\n")
    assert "treeserve: SIGINT: stopping" in lines, stopped.stderr
    assert (lines[0] == "treeserve: SIGINT: stopping") == (not bar), stopped.stderr


@pytest.mark.parametrize("question", ["", " \n\t"])
def test_the_cli_and_the_server_refuse_an_empty_question_by_one_check_in_search(question):
    """(the CLI and the server each had a copy of the check; now both ask search's, and say it alike)"""
    import argparse

    from treeserve import cli_search
    from treeserve.errors import ParamError
    from treeserve.runtime.scorer import given_question
    from treeserve.server.serving_search import question_and_system
    from treeserve.wire.errors import APIError
    from treeserve.wire.search import SearchRequest

    with pytest.raises(ParamError) as refused:
        given_question(question, "messages")
    assert (refused.value.param, str(refused.value)) == ("messages", "messages: the question is empty")
    assert given_question(" What is 2 + 2? ") == " What is 2 + 2? "
    with pytest.raises(argparse.ArgumentTypeError, match="^the question is empty$"):
        cli_search._question(question)
    for body, param in [({"question": question}, "question"),
                        ({"messages": [{"role": "user", "content": question}]}, "messages")]:
        with pytest.raises(APIError) as served:
            question_and_system(SearchRequest.model_validate(body))
        assert (served.value.status, served.value.param, served.value.message) == \
            (400, param, f"{param}: the question is empty")
