"""`ctxcache bench http`: the OpenAI-compatible HTTP front against gRPC, one server, one run.

A `ctxcache serve --http-port 0` process on the default model (CPU); one ~4K-token context put
through gRPC; then, round by round in rotating order, the same question answered greedily three
ways: gRPC Generate (streamed), HTTP chat completions naming the context (`cached_content`,
server-sent events), and HTTP with the context's text as the leading system message (found
automatically). Each is timed at this client: TTFT (request sent -> first token event) and
tokens/s after the first ((n - 1) / (last token event - first)). Compared pairwise within each
round (the three run back to back, so load from other jobs on the machine hits them alike) and
summarised by the median over rounds; the must-show: HTTP no more than 10% (or 5 ms) slower than
gRPC. The answers' token ids must be equal (greedy). The load average is recorded with them.

Before that, automatic caching as a new client meets it: the first HTTP request with the text as
its system message is a miss (the server builds the system message as a context and decodes the
answer over it, from the built artifact while the store write goes on: TTFT timed, the build
included; the server's log gives that build's split, build / store write left after it, so the
miss's TTFT minus its build is what the request waited beyond the build), and the same request
again is a hit (TTFT timed); their greedy tokens must be equal. That context is the one the gRPC
PutContext of the text then finds (same messages, method, codec and tenant: the same id), so the
rounds above compare the automatic context's hits with gRPC Generate by its id.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from ctxcache.bench.common.report import add_out, write_result
from ctxcache.bench.common.server_log import build_split
from ctxcache.client.server_process import running_server
from ctxcache.quality.texts import builtin_text, text_of_tokens
from ctxcache.client import Client
from ctxcache.client.gen.v1 import context_pb2 as pb

QUESTION = "In one sentence, what does this license say about distributing modified versions?"
_HTTP_PORT = re.compile(r"serving on \S+ \(admin \d+, http (\d+)\)")


def _timed(events) -> dict:
    """events: (token ids, ...) per event as they arrive -> TTFT, tok/s, the ids."""
    t0, stamps, ids = time.perf_counter(), [], []
    for tokens in events:
        if tokens:
            stamps.append(time.perf_counter())
            ids += tokens
    n = len(ids)
    tps = (n - 1) / (stamps[-1] - stamps[0]) if n > 1 and stamps[-1] > stamps[0] else 0.0
    return {"ttft_s": stamps[0] - t0 if stamps else None, "tokens_per_s": tps, "tokens": n, "ids": ids}


def _grpc(client: Client, cid: str, max_tokens: int) -> dict:
    req = pb.GenerateRequest(context_id=cid, question=QUESTION, sampling=pb.SamplingParams(max_tokens=max_tokens))
    final: list[pb.Final] = []

    def events():
        for e in client.generate(req, timeout=600):
            if e.HasField("final"):
                final.append(e.final)
            else:
                yield list(e.chunk.token_ids)
    out = _timed(events())
    return {**out, "server_ttft_s": final[0].timings.ttft_seconds}


def _http(http: httpx.Client, body: dict) -> dict:
    def events():
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:300]}")
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choices = json.loads(line[6:])["choices"]
                    yield choices[0].get("token_ids", []) if choices else []  # the usage chunk has none
    return _timed(events())


def _ways(client: Client, http: httpx.Client, cid: str, text: str, max_tokens: int,
          model: str) -> dict[str, Callable[[], dict]]:
    ask = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True, "return_token_ids": True}
    return {"grpc": lambda: _grpc(client, cid, max_tokens),
            "http_reference": lambda: _http(http, {**ask, "cached_content": cid,
                                                   "messages": [{"role": "user", "content": QUESTION}]}),
            "http_automatic": lambda: _http(http, {**ask, "messages": [{"role": "system", "content": text},
                                                                      {"role": "user", "content": QUESTION}]})}


def first_and_repeat(http: httpx.Client, text: str, args, log: Path) -> dict:
    """A miss (its prefix's build included), then the same request as a hit (one each); log:
    the server's (-v), for the build's split."""
    ask = {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
           "return_token_ids": True, "messages": [{"role": "system", "content": text},
                                                  {"role": "user", "content": QUESTION}]}
    miss = _http(http, ask)
    t0 = time.perf_counter()
    while True:
        listed = http.get("/v1/cached_contents").json()["cached_contents"]
        if listed and listed[0]["state"] != "BUILDING":
            break
        if time.perf_counter() - t0 > 3600:
            raise RuntimeError("the automatic context was not built within an hour")
        time.sleep(0.5)
    if listed[0]["state"] != "READY":
        raise RuntimeError(f"the automatic context failed: {listed[0]['error']}")
    built = time.perf_counter() - t0
    hit = _http(http, ask)
    split = build_split(log, [listed[0]["id"]])
    early = f"a miss decodes from the build of {listed[0]['id'][:12]}" in log.read_text(errors="replace")
    waited = None if split["put_build_s"] is None else miss["ttft_s"] - split["put_build_s"]
    return {"miss_ttft_s": miss["ttft_s"], "hit_ttft_s": hit["ttft_s"], "miss_over_hit": miss["ttft_s"] / hit["ttft_s"],
            "miss_build_s": split["put_build_s"], "miss_write_after_build_s": split["put_write_after_build_s"],
            "miss_ttft_beyond_build_s": waited, "miss_decoded_from_build": early,
            "auto_context_id": listed[0]["id"], "auto_context_tokens": listed[0]["usage_metadata"]["total_token_count"],
            "auto_build_after_answer_s": built, "miss_tokens_per_s": miss["tokens_per_s"],
            "hit_same_tokens_as_miss": hit["ids"] == miss["ids"]}


def measure(client: Client, http: httpx.Client, text: str, args, log: Path) -> dict:
    first = first_and_repeat(http, text, args, log)
    t0 = time.perf_counter()
    info = client.put(pb.PutContextRequest(text=text, wait=True), timeout=3600).context
    if info.state != pb.CONTEXT_STATE_READY:
        raise RuntimeError(f"PutContext failed: {info.error}")
    ways = _ways(client, http, info.context_id, text, args.max_tokens, args.model)
    for run in ways.values():
        run()  # warm: the artifact in DRAM, first-call costs paid
    runs: dict[str, list[dict]] = {name: [] for name in ways}
    names = list(ways)
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            runs[name].append(ways[name]())
    if info.context_id != first["auto_context_id"]:
        raise RuntimeError(f"PutContext gave {info.context_id}, not the automatic context {first['auto_context_id']}")
    out = {"first_and_repeat": first, "context_tokens": info.n_tokens, "put_s": time.perf_counter() - t0,
           "max_tokens": args.max_tokens,
           "load_average_1min": [round(load, 2), round(os.getloadavg()[0], 2)], "cpu_count": os.cpu_count(),
           "same_tokens": all(x["ids"] == runs["grpc"][0]["ids"] for rs in runs.values() for x in rs)}
    for name, rs in runs.items():
        out[name] = {"ttft_s": statistics.median(x["ttft_s"] for x in rs),
                     "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                     "ttft_all_s": [round(x["ttft_s"], 4) for x in rs],
                     "tokens_per_s_all": [round(x["tokens_per_s"], 2) for x in rs], "tokens": rs[0]["tokens"]}
    # what a gRPC call adds to TTFT (this client's TTFT minus the server's own): the least a
    # front in a process of its own, calling the server through gRPC, would add to HTTP's
    out["grpc"]["call_overhead_ms"] = statistics.median(1000 * (x["ttft_s"] - x["server_ttft_s"])
                                                        for x in runs["grpc"])
    for name in ("http_reference", "http_automatic"):
        pairs = list(zip(runs[name], runs["grpc"]))
        h = out[name]
        h["ttft_delta_ms"] = statistics.median(1000 * (x["ttft_s"] - g["ttft_s"]) for x, g in pairs)
        h["ttft_ratio"] = statistics.median(x["ttft_s"] / g["ttft_s"] for x, g in pairs)
        h["tokens_per_s_ratio"] = statistics.median(x["tokens_per_s"] / g["tokens_per_s"] for x, g in pairs)
        h["within"] = (h["ttft_ratio"] <= 1.10 or h["ttft_delta_ms"] <= 5) and h["tokens_per_s_ratio"] >= 0.90
    return out


def run(args) -> dict:
    from ctxcache.models.loader import load_model

    tokenizer = load_model(args.model).tokenizer  # only to cut the text to --tokens
    text = text_of_tokens(tokenizer, builtin_text("prose"), args.tokens)
    flags = ["--model", args.model, "--http-port", "0", "--max-streams", "4"]
    flags += ["--threads", str(args.threads)] if args.threads else []
    with tempfile.TemporaryDirectory(prefix="ctxcache-bench-") as tmp, \
            running_server([*flags, "--data", str(Path(tmp) / "data")], Path(tmp) / "serve.log",
                           verbose=True) as address:  # its "built" line: build_split
        port = _HTTP_PORT.search((Path(tmp) / "serve.log").read_text())[1]
        client = Client(address)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
                return measure(client, http, text, args, Path(tmp) / "serve.log")
        finally:
            client.close()


def table(r: dict) -> str:
    g = r["grpc"]
    rows = [("", "TTFT median", "tok/s median", "vs gRPC, median of the rounds' pairs"),
            ("gRPC Generate", f"{g['ttft_s'] * 1000:.1f} ms", f"{g['tokens_per_s']:.2f}", "")]
    for name, label in (("http_reference", "HTTP, cached_content"), ("http_automatic", "HTTP, automatic")):
        h = r[name]
        rows.append((label, f"{h['ttft_s'] * 1000:.1f} ms", f"{h['tokens_per_s']:.2f}",
                     f"TTFT {h['ttft_delta_ms']:+.1f} ms ({h['ttft_ratio']:.3f}x), tok/s {h['tokens_per_s_ratio']:.3f}x"
                     f" -> {'within' if h['within'] else 'NOT within'} 10% (or 5 ms) of gRPC"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    f = r["first_and_repeat"]
    lines.append(f"automatic caching: first request (miss) TTFT {f['miss_ttft_s'] * 1000:.0f} ms, repeat (hit) "
                 f"{f['hit_ttft_s'] * 1000:.0f} ms ({f['miss_over_hit']:.1f}x); the miss's TTFT = its prefix's build "
                 f"{_s(f.get('miss_build_s'))} + {_s(f.get('miss_ttft_beyond_build_s'))} (the store write left after "
                 f"the build: {_s(f.get('miss_write_after_build_s'))}; decoded from the built artifact, not "
                 f"the store: {f.get('miss_decoded_from_build')}); the context was READY "
                 f"{f['auto_build_after_answer_s']:.0f} s after the miss's answer; hit's tokens = miss's: "
                 f"{f['hit_same_tokens_as_miss']}")
    return "\n".join(lines + [f"a gRPC call's own share of TTFT (client - server): {g['call_overhead_ms']:.1f} ms",
                              f"context {r['context_tokens']} tokens, {r['max_tokens']} tokens per answer, "
                              f"same greedy tokens all ways: {r['same_tokens']}, load average "
                              f"{r['load_average_1min'][0]} -> {r['load_average_1min'][1]} on {r['cpu_count']} cores"])


def _s(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctxcache bench http", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out(ap)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=4096, help="context length in tokens")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    ap.add_argument("--rounds", type=int, default=6, help="measured answers per way (after one warm-up each)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads of the server (0: torch's default)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 2 or args.tokens < 64:
        ap.error(f"--rounds {args.rounds} >= 1, --max-tokens {args.max_tokens} >= 2, --tokens {args.tokens} >= 64")
    result = {"args": vars(args), **run(args)}
    print(table(result))
    print(f"wrote {write_result('http', result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
