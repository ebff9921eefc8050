"""`ctxcache bench compare`: method specs, cells, and the merge of shard JSONs into one report."""

import argparse
import json

import pytest

from ctxcache.bench.compare import all_cells, config_of, method_specs, parse_args
from ctxcache.bench.compare import merge


def test_magicpig_expands_to_the_paper_configs_and_unknown_names_fail():
    labels = [m.label for m in method_specs("full,csattention,magicpig")]
    assert labels == ["full", "csattention", "magicpig-K8-L75", "magicpig-K9-L120", "magicpig-K10-L150"]
    with pytest.raises(ValueError, match="nope"):
        method_specs("csattention,nope")


def test_cells_cover_texts_methods_tasks_and_seeds():
    cfg = config_of(parse_args(["--methods", "full,csattention", "--tasks", "passkey,vt",
                                "--task-lengths", "2048,4096", "--seeds", "0,1", "--retention-lengths", ""]))
    cells = all_cells(cfg)
    assert len(cells) == 2 * 2 + 2 * 2 * 2  # fidelity: texts x methods; tasks: lengths x tasks x seeds
    assert "fid:code:csattention" in cells and "task:4096:vt:1" in cells


def test_methods_take_parameters_and_retention_cells_can_run_alone():
    specs = method_specs("full,csattention@rerank=4,csattention@rerank=2@centroids=256")
    assert [(m.label, m.name, m.params) for m in specs][1:] == [
        ("csattention@rerank=4", "csattention", {"rerank": 4}),
        ("csattention@rerank=2@centroids=256", "csattention", {"rerank": 2, "centroids": 256})]
    with pytest.raises(ValueError, match="rerank=0.5"):
        method_specs("csattention@rerank=0.5")
    with pytest.raises(ValueError, match="key=value"):
        method_specs("csattention@rerank")
    cfg = config_of(parse_args(["--methods", "full,csattention", "--skip", "fid,task",
                                "--retention-lengths", "2048,6144", "--retention-seeds", "0,1,2"]))
    cells = all_cells(cfg)
    assert len(cells) == 2 * 3 * 6 and "ret:6144:changelog:2" in cells  # lengths x seeds x kinds of document


def _shard(path, cfg, cells):
    path.write_text(json.dumps({"bench": "compare", "config": cfg, "machine": {"cpu": "test cpu", "cpu_count": 2},
                                "date": "2026-11-22", "cells": cells}))


def _fid(text, method, keep, recall):
    return {"kind": "fidelity", "text": text, "method": method, "name": method, "params": {}, "keep": keep,
            "mass_recall": recall, "top1_agreement": 0.9, "nll_delta_pct": 1.0, "search_us": 10.0}


def _task(method, keep, score, task="passkey", length=2048):
    return {"kind": "task", "task": task, "n_tokens": length, "filler": "prose", "method": method, "keep": keep,
            "seed": 0, "score": score, "output": "", "length": length}


def test_merge_writes_one_table_json_and_plot(tmp_path):
    args = parse_args(["--methods", "full,csattention", "--keeps", "0.05", "--tasks", "passkey",
                       "--task-lengths", "2048", "--seeds", "0", "--retention-lengths", ""])
    cfg = config_of(args)
    shards = tmp_path / "shards"
    shards.mkdir()
    _shard(shards / "a.json", cfg, {"fid:prose:csattention": {"rows": [_fid("prose", "csattention", 0.05, 0.9)],
                                                              "seconds": 1.0}})
    _shard(shards / "b.json", cfg, {"task:2048:passkey:0": {"rows": [_task("full", None, 1.0),
                                                                     _task("csattention", 0.05, 0.5)],
                                                            "seconds": 2.0}})
    paths = merge(argparse.Namespace(merge=str(shards), results=str(tmp_path / "out"), name=None))
    report = json.loads(paths["json"].read_text())
    cs = next(r for r in report["rows"] if r["method"] == "csattention")
    assert cs["fidelity"]["prose"]["mass_recall"] == 0.9 and cs["tasks"]["2048"]["mean"] == 0.5
    assert set(report["missing_cells"]) == {"fid:prose:full", "fid:code:full", "fid:code:csattention"}
    md = paths["md"].read_text()
    assert "| csattention | 0.05 |" in md and "INCOMPLETE: 3 cells missing" in md
    assert paths["png"].stat().st_size > 0


def _ret(method, keep, question, score, length=2048):
    return {"kind": "retention", "length": length, "filler": "prose", "seed": 0, "question": question,
            "qkind": "ticket", "depth": 0.1, "method": method, "keep": keep, "score": score,
            "read_per_key": 50.0, "read_x_dense": 0.2}


def test_merge_reports_retention_beside_mass_recall(tmp_path):
    args = parse_args(["--methods", "full,oracle,csattention", "--keeps", "0.05", "--skip", "task",
                       "--retention-lengths", "2048", "--retention-seeds", "0", "--retention-fillers", "prose"])
    cfg = config_of(args)
    shards = tmp_path / "shards"
    shards.mkdir()
    rows = ([_ret("full", None, i, 1.0) for i in range(4)] + [_ret("oracle", 0.05, i, 1.0) for i in range(4)]
            + [_ret("csattention", 0.05, i, float(i < 1)) for i in range(4)])
    _shard(shards / "a.json", cfg, {"ret:2048:prose:0": {"rows": rows, "seconds": 1.0},
                                    "fid:prose:csattention": {"rows": [_fid("prose", "csattention", 0.05, 0.9)],
                                                              "seconds": 1.0}})
    paths = merge(argparse.Namespace(merge=str(shards), results=str(tmp_path / "out"), name=None))
    cs = next(r for r in json.loads(paths["json"].read_text())["rows"] if r["method"] == "csattention")
    assert cs["retention"]["kept"] == 0.25 and cs["retention"]["vs_oracle_losses"] == 3
    assert cs["retention"]["slices"]["@2048"] == 0.25 and cs["retention"]["slices"]["depth 0.1"] == 0.25
    assert cs["retention"]["slices"]["number"] is None
    sl = cs["retention"]["slices"]  # question kind and filler are separate slices
    assert sl["ticket"] == 0.25 and sl["in prose"] == 0.25 and "in code" not in sl
    kind = cs["retention"]["by_kind"]["prose"]  # per kind of document, the oracle's fraction beside
    assert (kind["kept"], kind["oracle_kept"], kind["vs_oracle_losses"]) == (0.25, 1.0, 3)
    md = paths["md"].read_text()
    assert "| 0.250 (4) | 0 / 3 | 0.250 |" in md and "Retention by slice" in md
    assert "| csattention | 0.05 | 50.0 (0.200) | 0.250 (4) 0/3 p=0.25 | 0.250 (4) 0/3 p=0.25 |" in md
    assert "tasks @" not in md  # the task suite was skipped: no empty columns for it
    assert paths["png"].stat().st_size > 0


def test_merge_refuses_shards_of_other_configurations(tmp_path):
    a = config_of(parse_args(["--keeps", "0.05"]))
    b = config_of(parse_args(["--keeps", "0.10"]))
    _shard(tmp_path / "a.json", a, {})
    _shard(tmp_path / "b.json", b, {})
    with pytest.raises(ValueError, match="same configuration"):
        merge(argparse.Namespace(merge=str(tmp_path), results=str(tmp_path / "out"), name=None))


def test_text_benches_refuse_a_missing_text_file(capsys):
    from ctxcache.bench.fidelity import parse_args as fidelity_args
    with pytest.raises(SystemExit):
        fidelity_args(["--text", "/no/such/file.txt"])
    assert "is neither one of ('prose', 'code', 'narrative'" in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["attention", "offload"])
def test_gpu_benches_refuse_bad_size_lists_before_looking_for_a_gpu(bench, capsys):
    import importlib
    main = importlib.import_module(f"ctxcache.bench.{bench}").main
    for flag, bad, why in (("--batches", "1,x", "not a comma-separated list"), ("--contexts", "0", "must be positive")):
        with pytest.raises(SystemExit) as exc:
            main([flag, bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and why in err


def test_gpu_bench_grid_runs_every_batch_and_context():
    from ctxcache.bench.common.gpu import grid_points, positive_ints
    args = argparse.Namespace(batches=positive_ints("1,8"), contexts=positive_ints("8192,131072"))
    assert list(grid_points(args)) == [(1, 8192), (1, 131072), (8, 8192), (8, 131072)]


def test_a_retention_run_reports_its_tables_alone(tmp_path):
    args = parse_args(["--methods", "full,oracle,csattention", "--keeps", "0.05", "--skip", "fid,task",
                       "--retention-lengths", "2048", "--retention-seeds", "0", "--retention-fillers", "prose"])
    shards = tmp_path / "shards"
    shards.mkdir()
    rows = ([_ret("full", None, i, 1.0) for i in range(4)] + [_ret("oracle", 0.05, i, 1.0) for i in range(4)]
            + [_ret("csattention", 0.05, i, float(i < 3)) for i in range(4)])
    _shard(shards / "a.json", config_of(args), {"ret:2048:prose:0": {"rows": rows, "seconds": 1.0}})
    paths = merge(argparse.Namespace(merge=str(shards), results=str(tmp_path / "out"), name=None))
    md = paths["md"].read_text()
    assert "mass recall" not in md and "| csattention | 0.05 | 50.0 (0.200) | 0.750 (4) 0/1 p=1 |" in md
    assert paths["png"].stat().st_size > 0
