"""`ctxcache bench storage`: what a stored context costs and what it keeps, per K/V codec.

Through the product path: indexer.build_artifact (CSAttention stores its centroids; the dense
rows are derived at load), ArtifactStore.put/get in a temporary LMDB, the decoder's
restore_tables and ReferenceRunner.admit. Per text and codec:
- stored bytes / fp16 K/V bytes of the artifact (the query sample is opt-in and not kept);
- cold TTFT: a fresh store handle, LMDB to the first token of a question of --question tokens
  (the OS page cache is not dropped: this is a shared box);
- mass recall of the selection from the stored artifact (targets from the true K/V) and the
  teacher-forced NLL change vs full attention; "built" is the same method's tables built in
  memory from the dense capture (no store, no codec): the reference for "against today";
- passkey at --passkey-lengths through the store, and full attention decoding the lossless
  artifact through the same path (every layer dense).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from ctxcache.artifact import KV_CODECS, ContextArtifact
from ctxcache.decoder import SparseConfig
from ctxcache.decoder.reference_attention import ReferenceSparseAttention
from ctxcache.decoder.runner import ReferenceRunner
from ctxcache.decoder.session import generate, restore_tables
from ctxcache.generation import SamplingParams, prefill
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import Budget, SparseMethod, make_method
from ctxcache.models.loader import DEFAULT_MODEL, LoadedModel, load_model
from ctxcache.store import ArtifactStore, Manifest, StoreConfig

from ctxcache.quality.capture import Captured, build_tables, capture
from ctxcache.quality.model_scores import make_trial, teacher_forced
from ctxcache.bench.common.report import parse_text_args, print_table, write_result
from ctxcache.quality.selection import selection_metrics
from ctxcache.quality.texts import builtin_text, tokens_of

COLUMNS = ["text", "variant", "stored_over_kv", "resident_over_kv", "cold_ttft_s", "load_s", "lmdb_read_s",
           "kv_decode_s", "restore_s", "question_prefill_s", "mass_recall",
           "mass_recall_change", "nll_delta_pct", "nll_change_points", "top1_agreement"]
STORE = StoreConfig(map_size_bytes=8 << 30, budget_bytes=8 << 30)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ctxcache bench storage", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--continuation", type=int, default=128, help="teacher-forced decode steps")
    ap.add_argument("--texts", default="prose,code")
    ap.add_argument("--text", default="prose", help=argparse.SUPPRESS)  # checked by parse_text_args
    ap.add_argument("--codecs", default=",".join(KV_CODECS))
    ap.add_argument("--keep", type=float, default=0.05)
    ap.add_argument("--question", type=int, default=20, help="question tokens of the cold TTFT")
    ap.add_argument("--repeats", type=int, default=3, help="cold TTFT runs (median)")
    ap.add_argument("--stride", type=int, default=16, help="score every stride-th decode step")
    ap.add_argument("--passkey-lengths", default="2048,4096")
    ap.add_argument("--passkey-trials", type=int, default=5, help="0 skips passkey")
    ap.add_argument("--ttft-only", action="store_true", help="bytes and cold TTFT only (no fidelity, no passkey)")
    return parse_text_args(ap, argv, 2)


def stored(art: ContextArtifact, codec: str, path: Path) -> tuple[Manifest, ContextArtifact]:
    """Put the artifact under `codec` into a fresh store at path; -> (manifest, what get returns)."""
    with ArtifactStore(path, STORE) as s:
        m = s.put("c", replace(art, kv_codec=codec))
        return m, s.get("c")


@torch.inference_mode()
def cold_ttft(lm: LoadedModel, path: Path, question: list[int], config: SparseConfig) -> tuple[float, float]:
    """LMDB to the first token through a fresh store handle: -> (seconds, of which the get)."""
    t0 = time.perf_counter()
    with ArtifactStore(path, replace(STORE, track_access=False)) as s:
        art = s.get("c")
    t_get = time.perf_counter() - t0
    _, first = ReferenceRunner(lm).admit("c", art, question, config, 8)
    int(first.argmax())
    return time.perf_counter() - t0, t_get


PHASES = ("lmdb_read_s", "kv_decode_s", "restore_s", "question_prefill_s")


@torch.inference_mode()
def cold_phases(lm: LoadedModel, path: Path, question: list[int], config: SparseConfig) -> dict[str, float]:
    """The cold TTFT's parts, timed through the calls ReferenceRunner.admit makes (start_batch):
    the store's get (LMDB, checksums, codes into memory), the K/V decoded into the cache, the
    method's restore (CSAttention: its fp64 row keys), the question's prefill to the first token."""
    t = [time.perf_counter()]
    with ArtifactStore(path, replace(STORE, track_access=False)) as s:
        art = s.get("c")
    t.append(time.perf_counter())
    n, method = art.n_tokens, make_method(art.method, art.method_params)
    cache = lm.model.new_cache(1, max_len=n + len(question) + 8, uninitialized=True)
    cache.fill_row(0, n, lambda i, k, v: art.layers[i].kv_into(k, v))
    t.append(time.perf_counter())
    keys = [cache.k[i][0, :, :n] for i in range(len(art.layers))]
    states = [method.open(x) for x in restore_tables(method, art, "cpu", True, keys)]
    t.append(time.perf_counter())
    attn = ReferenceSparseAttention(method, [states], config)
    int(prefill(lm.model, torch.tensor([question]), cache.row(0), attn.row_view(0))[0].argmax())
    t.append(time.perf_counter())
    return {name: b - a for name, a, b in zip(PHASES, t, t[1:])}


def decoded_capture(cap: Captured, art: ContextArtifact) -> Captured:
    """The capture with its context K/V replaced by the artifact's (as loaded from the store)."""
    n = cap.n_context
    ks = [torch.cat([l.k.to(k.dtype), k[:, n:]], 1) for l, k in zip(art.layers, cap.k)]
    vs = [torch.cat([l.v.to(v.dtype), v[:, n:]], 1) for l, v in zip(art.layers, cap.v)]
    return Captured(n, cap.q, ks, vs, cap.logits)


def resident_bytes(method: SparseMethod, art: ContextArtifact) -> int:
    hkv = art.layers[0].k.shape[0]
    return art.kv_bytes() + art.table_bytes() + len(art.layers) * method.derived_bytes(art.n_tokens, hkv)


def text_rows(lm: LoadedModel, text: str, args: argparse.Namespace, codecs: list[str], work: Path) -> list[dict]:
    method, config = make_method("csattention"), SparseConfig(Budget(args.keep))
    ids = tokens_of(lm.tokenizer, builtin_text(text), args.tokens + args.continuation, text)
    if args.ttft_only:
        return ttft_rows(lm, ids, args, codecs, work, text)
    cap = capture(lm, ids, args.tokens)
    in_memory = build_tables(method, cap)
    built = {"text": text, "variant": "built (in memory)", "mass_recall": selection_metrics(
        method, in_memory, cap, config.budget, args.stride)["mass_recall"]}
    built.update(teacher_forced(lm, ids, cap, method, in_memory, config))
    del in_memory
    rows = [built]
    art = build_artifact(lm, ids[:args.tokens], method, IndexerConfig(progress=False))
    question = ids[args.tokens:args.tokens + args.question]
    for codec in codecs:
        path = work / f"{text}-{codec}"
        m, loaded = stored(art, codec, path)
        times = sorted(cold_ttft(lm, path, question, config) for _ in range(args.repeats))
        dec = decoded_capture(cap, loaded)
        tables = restore_tables(method, loaded, "cpu", on_demand=True)  # as the reference decoder
        row = {"text": text, "variant": codec, "stored_bytes": m.stored_bytes, "kv_fp16_bytes": art.kv_bytes(),
               "stored_over_kv": m.stored_bytes / art.kv_bytes(),
               "resident_over_kv": resident_bytes(method, loaded) / art.kv_bytes(),
               "cold_ttft_s": times[len(times) // 2][0], "load_s": times[len(times) // 2][1],
               "mass_recall": selection_metrics(method, tables, dec, config.budget, args.stride, truth=cap)["mass_recall"]}
        row.update(teacher_forced(lm, ids, dec, method, tables, config))
        row["mass_recall_change"] = row["mass_recall"] - built["mass_recall"]
        row["nll_change_points"] = row["nll_delta_pct"] - built["nll_delta_pct"]
        rows.append(row)
        print(f"[storage] {text} {codec}: {row['stored_over_kv']:.3f}x, cold TTFT {row['cold_ttft_s']:.2f}s",
              file=sys.stderr, flush=True)
    return rows


def ttft_rows(lm: LoadedModel, ids: list[int], args: argparse.Namespace, codecs: list[str], work: Path,
              text: str) -> list[dict]:
    """Stored bytes and cold TTFT per codec (--ttft-only)."""
    method, config = make_method("csattention"), SparseConfig(Budget(args.keep))
    art = build_artifact(lm, ids[:args.tokens], method, IndexerConfig(progress=False))
    question, rows = ids[args.tokens:args.tokens + args.question], []
    for codec in codecs:
        path = work / f"{text}-{codec}"
        m, _ = stored(art, codec, path)
        times, phases = [], []
        for _ in range(args.repeats):  # alternated, so both see the same load on a shared box
            times.append(cold_ttft(lm, path, question, config))
            phases.append(cold_phases(lm, path, question, config))
        times.sort()
        rows.append({"text": text, "variant": codec, "stored_bytes": m.stored_bytes, "kv_fp16_bytes": art.kv_bytes(),
                     "stored_over_kv": m.stored_bytes / art.kv_bytes(), "cold_ttft_s": times[len(times) // 2][0],
                     "load_s": times[len(times) // 2][1], "cold_ttft_all_s": [t for t, _ in times],
                     **{p: statistics.median(x[p] for x in phases) for p in PHASES}})
    return rows


@torch.inference_mode()
def passkey(lm: LoadedModel, lengths: list[int], trials: int, codecs: list[str], keep: float, work: Path) -> dict:
    """Accuracy per length and variant ("full" and each codec) over the same seeded trials."""
    method, sparse = make_method("csattention"), SparseConfig(Budget(keep))
    dense = SparseConfig(Budget(keep), dense_layers=tuple(range(lm.args.n_layers)))
    out = {}
    for length in lengths:
        hits = dict.fromkeys(["full", *codecs], 0)
        for i in range(trials):
            trial = make_trial(lm.tokenizer, length, 1234 + i)
            art = build_artifact(lm, trial.context_ids, method, IndexerConfig(progress=False))
            for codec in ["full", *codecs]:
                _, loaded = stored(art, "lossless" if codec == "full" else codec, work / f"pk-{length}-{i}-{codec}")
                steps = generate(lm, [loaded], [trial.question_ids], SamplingParams(max_tokens=8),
                                 dense if codec == "full" else sparse)
                answer = lm.tokenizer.decode([int(t[0]) for t, _ in steps])
                hits[codec] += int(re.search(rf"\b{trial.key}\b", answer) is not None)
        out[str(length)] = {k: f"{v}/{trials}" for k, v in hits.items()}
        print(f"[storage] passkey {length}: {out[str(length)]}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    codecs = [c for c in args.codecs.split(",") if c]
    bad = sorted(set(codecs) - set(KV_CODECS))
    if bad:
        print(f"ctxcache bench storage: error: codecs {bad}; known: {KV_CODECS}", file=sys.stderr)
        return 2
    lm = load_model(args.model)
    with tempfile.TemporaryDirectory(prefix="ctxcache-storage-") as tmp:
        try:
            rows = [r for text in args.texts.split(",") for r in text_rows(lm, text, args, codecs, Path(tmp))]
        except ValueError as e:
            print(f"ctxcache bench storage: error: {e}", file=sys.stderr)
            return 2
        lengths = [int(x) for x in args.passkey_lengths.split(",") if x] if args.passkey_trials and not args.ttft_only else []
        keys = passkey(lm, lengths, args.passkey_trials, codecs, args.keep, Path(tmp))
    print(f"model={lm.model_id} tokens={args.tokens} keep={args.keep} (page cache not dropped)")
    print_table(rows, COLUMNS)
    print_table([{"length": k, **v} for k, v in keys.items()], ["length", "full", *codecs])
    payload = {"model": lm.model_id, "torch_threads": torch.get_num_threads(), "tokens": args.tokens, "keep": args.keep, "question_tokens": args.question,
               "page_cache_dropped": False, "rows": rows, "passkey": keys}
    print(f"wrote {write_result('storage_ttft' if args.ttft_only else 'storage', payload, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
