"""`ctxcache bench decode_modes`: the reference runner's decode step, sparse vs dense, per
context length (CPU): the measurements behind `--decode-mode auto`'s CPU entry
(decoder/decode_mode.py; tests/core/test_decode_mode_table.py checks the entry against this file).

One process, one stream, greedy: per context length an artifact is built once, then each
repeat admits a stream in each mode in turn (interleaved, so load from other processes falls on
both) and times `--steps` decode steps; medians of the repeats. The load average is recorded
beside the numbers: on a shared box read them with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch

from ctxcache.bench.common.report import add_out, write_result
from ctxcache.quality.texts import builtin_text, text_of_tokens

QUESTION = "What does the license say about distributing modified versions?"


def _time_mode(runner, art, prompt: list[int], config, steps: int) -> tuple[float, list[int]]:
    """Seconds per decode step over `steps` steps after one untimed step, and the tokens."""
    row, first = runner.admit("bench", art, prompt, config, steps + 2)
    tokens = [int(first.argmax())]
    tokens.append(int(runner.step([row], [tokens[-1]])[0].argmax()))
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens.append(int(runner.step([row], [tokens[-1]])[0].argmax()))
    return (time.perf_counter() - t0) / steps, tokens


def run(args) -> dict:
    from ctxcache.decoder import SparseConfig
    from ctxcache.decoder.runner import ReferenceRunner
    from ctxcache.indexer import IndexerConfig, build_artifact
    from ctxcache.methods import make_method
    from ctxcache.models.loader import load_model

    lm = load_model(args.model)
    runner = ReferenceRunner(lm)
    sparse = SparseConfig.from_schedule(args.schedule)
    modes = {"sparse": sparse, "dense": replace(sparse, dense_layers=tuple(range(lm.args.n_layers)))}
    prompt = lm.tokenizer.encode(QUESTION)
    rows = []
    for n in args.tokens:
        context = lm.tokenizer.encode(text_of_tokens(lm.tokenizer, builtin_text("prose"), n))[:n]
        art = build_artifact(lm, context, make_method(args.method), IndexerConfig(kv_dtype="float16", coded_kv=True))
        times: dict[str, list[float]] = {m: [] for m in modes}
        load = []
        for _ in range(args.repeats):
            for mode, config in modes.items():
                seconds, _ = _time_mode(runner, art, prompt, config, args.steps)
                times[mode].append(seconds)
                load.append(os.getloadavg()[0])
        for mode in modes:
            step = statistics.median(times[mode])
            rows.append({"context_tokens": art.n_tokens, "mode": mode, "step_ms": [t * 1e3 for t in times[mode]],
                         "median_step_ms": step * 1e3, "aggregate_tokens_per_s": 1 / step,
                         "load_avg_1m": [round(x, 2) for x in load]})
    return {"model": lm.model_id, "method": args.method, "schedule": args.schedule, "steps": args.steps,
            "repeats": args.repeats, "rows": rows}


def table(r: dict) -> str:
    lines = ["| context tokens | mode | step ms (median) | tok/s | load (1 min) |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {x['context_tokens']} | {x['mode']} | {x['median_step_ms']:.1f} | {x['aggregate_tokens_per_s']:.1f} | "
              f"{min(x['load_avg_1m']):.1f}-{max(x['load_avg_1m']):.1f} |" for x in r["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench decode_modes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(ap)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--method", default="csattention")
    ap.add_argument("--schedule", default="0.05-step-1")
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4000],
                    help="context lengths, comma-separated")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: one per usable core)")
    args = ap.parse_args(argv)
    if min(args.tokens) < 1 or args.steps < 1 or args.repeats < 1:
        ap.error(f"--tokens {args.tokens}, --steps {args.steps}, --repeats {args.repeats} must be >= 1")
    from ctxcache.models.cpu_layout import usable_cores
    torch.set_num_threads(args.threads or usable_cores())
    result = {"args": vars(args), **run(args)}
    print(table(result))
    print(f"wrote {write_result('decode_modes', result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
