"""bench step_profile: kernel events summed per step, largest first; a one-line refusal without a GPU."""

import pytest
import torch

from ctxcache.bench.step_profile import main, per_step


def test_events_are_summed_per_step_largest_first():
    events = [("a", 2.0), ("b", 5.0), ("a", 4.0), ("b", 5.0), ("c", 1.0), ("a", 6.0)]
    rows = per_step(events, steps=2)
    assert [r["kernel"] for r in rows] == ["a", "b", "c"]
    assert rows[0] == {"kernel": "a", "launches": 1.5, "us": 6.0}
    assert per_step(events, steps=2, top=1) == rows[:1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without a GPU gets")
def test_without_a_gpu_it_says_so_in_one_line(capsys):
    assert main(["--contexts", "1024"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err


@pytest.mark.parametrize("text, says", [
    ("{rerank: 3}", "Expecting property name"), ("[3]", "must be a JSON object"),
    ('{"rerank": 0.5}', "rerank=0.5 must be in"), ('{"rerank": 3, "x": 1}', "unknown")])
def test_method_params_are_checked_before_anything_runs(capsys, text, says):
    with pytest.raises(SystemExit) as exit_:
        main(["--method-params", "{}", text])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--method-params" in err and says in err and "Traceback" not in err


def test_method_params_parse_to_the_rows_params():
    from ctxcache.bench.step_profile import method_params

    assert method_params('{"rerank": 3}') == {"rerank": 3} and method_params("{}") == {}


@pytest.mark.parametrize("runs", ["0", "-1", "two"])
def test_runs_must_be_a_positive_count(capsys, runs):
    with pytest.raises(SystemExit) as exit_:
        main(["--runs", runs])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--runs" in err and "Traceback" not in err
