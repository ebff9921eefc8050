"""bench shapes: its --shapes parsing, the best valid shape per kernel, and one-line refusals."""

import pytest
import torch

from ctxcache.bench.shapes import best_rows, main, parse_shapes


def test_shapes_parse_and_bad_ones_are_named():
    assert parse_shapes("32768x8,126976x4") == [(32768, 8), (126976, 4)]
    for bad in ("32768", "32Kx8", "512x1", "32768x0", ""):
        with pytest.raises(ValueError):
            parse_shapes(bad)


def test_the_best_is_the_fastest_shape_with_the_defaults_output():
    base = {"kernel": "scores", "context": 32768, "batch": 8}
    rows = [{**base, "block": 1024, "time_us": 30.0, "same": True, "default": True},
            {**base, "block": 2048, "time_us": 20.0, "same": False, "default": False},  # other keys: not a candidate
            {**base, "block": 4096, "error": "no compile", "default": False},
            {**base, "block": 512, "time_us": 25.0, "same": True, "default": False},
            {**base, "kernel": "attention", "block_n": 64, "time_us": 9.0, "max_err": 0.5, "default": False},
            {**base, "kernel": "attention", "block_n": 128, "time_us": 10.0, "max_err": 0.0, "default": True}]
    got = {r["kernel"]: r for r in best_rows(rows)}
    assert got["scores"]["default_us"] == 30.0 and got["scores"]["best_us"] == 25.0
    assert got["scores"]["best"] == {"block": 512}
    assert got["attention"]["best_us"] == 10.0 and got["attention"]["best"] == {"block_n": 128}


@pytest.mark.parametrize("argv, says", [(["--shapes", "32Kx8"], "CONTEXTxBATCH"),
                                        (["--kernels", "scores,nope"], "choose from")])
def test_bad_input_is_one_line(capsys, argv, says):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without a GPU gets")
def test_without_a_gpu_it_says_so_in_one_line(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err
