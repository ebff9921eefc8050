"""The client side of `bench serve`: streams through the gRPC API alone, timed as a user sees
them (tokens/s, inter-token gaps, TTFT of a stream that joins while others decode)."""

from __future__ import annotations

import statistics
import time

from ctxcache.bench.common.report import run_together
from ctxcache.bench.common.serve_limits import gaps_ms
from ctxcache.client import Client
from ctxcache.client.gen.v1 import context_pb2 as pb

QUESTION = "Which of the facts above matters most? Answer in one line."  # ~20 tokens


def pctl(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def generate(client: Client, cid: str, max_tokens: int, arrivals: list[float] | None = None) -> pb.Final:
    """One stream; arrivals (if given) gets each token's arrival time (perf_counter)."""
    req = pb.GenerateRequest(context_id=cid, question=QUESTION, sampling=pb.SamplingParams(max_tokens=max_tokens))
    final = None
    for ev in client.generate(req, timeout=600):
        if ev.HasField("final"):
            final = ev.final
        elif arrivals is not None:
            arrivals.append(time.perf_counter())
    return final


def concurrent_rate(client: Client, cids: list[str], tokens: int) -> tuple[float, float, str, list[float], dict]:
    """Aggregate generated tok/s of one stream per context, all at once, the mean per-stream
    tok/s, the path, every stream's inter-token gaps (ms) and the run's starts (slowest TTFT,
    streams that missed the server's DRAM and GPU tiers). The client threads run in this
    process, the server in its own: they never take the decode loop's interpreter lock."""
    finals: list = [None] * len(cids)
    arrivals: list[list[float]] = [[] for _ in cids]

    def one(i: int) -> None:
        finals[i] = generate(client, cids[i], tokens, arrivals[i])

    wall = run_together([lambda i=i: one(i) for i in range(len(cids))])
    paths = {f.decode_path for f in finals}
    if len(paths) != 1:
        raise RuntimeError(f"streams were served by different paths: {sorted(paths)}")
    made = sum(f.usage.generated_tokens for f in finals)
    gaps = [g for a in arrivals for g in gaps_ms(a)]
    starts = {"ttft_max_s": max(f.timings.ttft_seconds for f in finals),
              "loads": sum(not f.timings.cache_hit for f in finals)}
    return made / wall, statistics.mean(f.timings.tokens_per_second for f in finals), paths.pop(), gaps, starts


def admission(client: Client, cids: list[str], tokens: int, joins: int = 16) -> dict:
    """Seven streams decode while one stream at a time joins on the eighth (hot) context: the
    joiners' TTFT and the seven's inter-token gaps while they join, against the seven's median."""
    arrivals: list[list[float]] = [[] for _ in cids[:7]]
    ttfts: list[float] = []
    firsts: list[float] = []  # when each joiner's first token arrived
    served: list[float] = []
    window: list[float] = []

    def joiner() -> None:
        time.sleep(0.5)  # the seven are decoding
        window.append(time.perf_counter())
        for _ in range(joins):  # TTFT as this client sees it: request sent to first token received
            t0, first = time.perf_counter(), []
            final = generate(client, cids[7], 1, first)
            ttfts.append(first[0] - t0 if first else final.timings.ttft_seconds)
            firsts.extend(first[:1])
            served.append(final.timings.ttft_seconds)  # inside the server: the rest is gRPC and this client
            time.sleep(0.05)
        window.append(time.perf_counter())

    run_together([lambda i=i: generate(client, cids[i], tokens * 3, arrivals[i]) for i in range(7)] + [joiner])
    during, all_gaps, ends = [], [], []
    for a in arrivals:
        for t0, t1 in zip(a, a[1:]):
            all_gaps.append(1e3 * (t1 - t0))
            if window and window[0] <= t1 <= window[-1]:
                during.append(1e3 * (t1 - t0))
                ends.append(t1)
    p99 = pctl(during, 0.99) if during else None  # None: the seven had ended before anyone joined
    return {"joiner_ttft_p50_ms": 1e3 * statistics.median(ttfts), "joiner_ttft_p99_ms": 1e3 * pctl(ttfts, 0.99),
            "joiner_ttfts_ms": [round(1e3 * t, 1) for t in ttfts],  # in order: p99 of 16 is their maximum
            "joiner_server_ttfts_ms": [round(1e3 * t, 1) for t in served],
            "others_itl_p50_ms": statistics.median(all_gaps), "others_itl_p99_during_ms": p99,
            "others_longest_during": _longest(during, ends, firsts),
            "others_itl_p99_during_over_p50": p99 / statistics.median(all_gaps) if p99 else None}


def _longest(gaps: list[float], ends: list[float], firsts: list[float], n: int = 8) -> list[list[float]]:
    """The n longest gaps (ms) during the joins, each with its end's offset (ms) from the nearest
    joiner's first token: a gap a joiner's prefill chunk lengthened ends about a step after it."""
    top = sorted(zip(gaps, ends), reverse=True)[:n]
    return [[round(g, 1), round(1e3 * min((e - f for f in firsts), key=abs), 1) if firsts else None] for g, e in top]
