"""`ctxcache` command line: flags are parsed here only; commands live in commands.py."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import sys
from pathlib import Path


DEFAULT_PORT = 50051


def address(value: str) -> str:
    """host[:port] -> host:port (a bare host means the default port, never gRPC's 443)."""
    host, sep, port = value.rpartition(":")
    if sep and port.isdigit() and host and not host.endswith(":"):
        return value
    if value.startswith("[") and value.endswith("]") or value.count(":") < 2:
        return f"{value}:{DEFAULT_PORT}"
    return value  # a bare IPv6 address with a port already, or something grpc will refuse clearly


def positive_int(value: str) -> int:
    if int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return int(value)


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show (None, a switch's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action)


def _client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", type=address, default=f"127.0.0.1:{DEFAULT_PORT}", help="server host[:port]")
    p.add_argument("--admin-address", type=address, default=None, help="admin host[:port] if served apart")
    p.add_argument("--token", default=None, help="bearer token (or env CTXCACHE_TOKEN)")
    p.add_argument("--tls-ca", type=Path, default=None, help="CA certificate for TLS")


def _service_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=Path, default="./data", help="LMDB store folder")
    p.add_argument("--store-budget-gb", type=float, default=16.0, help="stored bytes kept (LRU eviction beyond)")
    p.add_argument("--redis", default=None, help="redis://host:6379/0 (without: an embedded registry)")
    _model_flags(p)
    p.add_argument("--method", default="csattention", help="PutContext's default sparse method")
    p.add_argument("--method-params", default="{}",
                   help='the method\'s parameters as JSON (csattention: \'{"rerank": 1}\' trades answers kept for GPU speed, '
                        'DESIGN.md); the GPU runner serves contexts built with these')
    p.add_argument("--store-queries", type=int, default=1536,
                   help="prefill query positions kept per layer when a PutContext asks (keep_queries)")
    p.add_argument("--max-build-work", type=float, default=3e10,
                   help="refuse a PutContext whose index build clusters more than this many point-centroid "
                        "distances (default CSAttention: 1e9 on SmolLM2, 3e9 on Llama-3.1-8B); the server's own "
                        "--method and --method-params are always admitted")
    p.add_argument("--kv-codec", default="int8", choices=["lossless", "int8", "int4"],
                   help="PutContext's default K/V codec (README: bytes per token of each)")
    p.add_argument("--schedule", default="0.05-step-1", help="default sparse schedule")
    p.add_argument("--dram-cache-gb", type=float, default=2.0, help="loaded artifacts kept in memory (LRU)")
    p.add_argument("--host-pool-gb", type=float, default=None,
                   help="GPU: page-locked host memory registered at start that loads land in (default: the DRAM "
                        "cache + 4 GB); 0: each load locks its own, slower")
    p.add_argument("--max-streams", type=int, default=16, help="concurrent Generate streams; more are refused")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--max-batch", type=int, default=32,
                   help="concurrent streams decoded together per step (continuous batching)")
    _decode_mode_flag(p)
    p.add_argument("--gpu-slots", type=int, default=None,
                   help="GPU: contexts resident in HBM and decoded together (each takes a slot of "
                        "--gpu-slot-tokens; default 4, or as many as --gpu-memory-gb holds)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="GPU: HBM for resident contexts (K/V, and the index when sparse); the slots are as "
                        "many as it holds in the decode mode (`admin stats` shows them); not with --gpu-slots")
    p.add_argument("--offload", action="store_true",
                   help="GPU, sparse: a context longer than a slot (or past the busy slots) decodes with its V in "
                        "pinned host memory (the index, K and a cache of the selected keys' V on the GPU) instead of "
                        "the slow reference path")
    p.add_argument("--gpu-slot-tokens", type=int, default=33792, help="GPU: tokens per slot (context + question + answer)")
    p.add_argument("--offload-slots", type=int, default=4,
                   help="with --offload: offloaded streams decoded together in one batched step (host slots)")
    p.add_argument("--offload-slot-tokens", type=int, default=0,
                   help="with --offload: tokens per host slot (default 0: the model's length); the slots are "
                        "page-locked at start: V, layers x KV heads x head_dim x 2 bytes a token each (Llama-3.1-8B "
                        "bf16: 64 KiB a token, 8 GiB a 128K slot; K too with --offload-k host)")
    p.add_argument("--offload-k", choices=("hbm", "host"), default="hbm",
                   help="with --offload: hbm (default) keeps each host slot's K in HBM too (64 KiB a token at "
                        "Llama-3.1-8B bf16; refused at start when it does not fit), so only V crosses PCIe; host "
                        "reads K over PCIe too")
    p.add_argument("--offload-v-cache", type=float, default=8.0,
                   help="with --offload: V rows a host slot's GPU cache holds (per layer and KV head), as a multiple "
                        "of the selection (default 8, in [1, 64]; Llama-3.1-8B bf16 at 32K: 0.1 GiB of HBM a slot each)")
    p.add_argument("--offload-prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="with --offload: a hot question's prefill on an offloaded context replayed as CUDA graphs "
                        "(captured per host slot, context length and padded question length, checked against the "
                        "eager prefill at warm-up), as a resident slot's (default on; --no-offload-prefill-graphs: eager)")


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (bundled), a Hugging Face Llama / Mistral / Qwen2 / Qwen3 checkpoint (local path "
                        "or hub id), or random:<config> (random weights, e.g. random:llama-3.1-8b)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (a GPU decodes on the fast runner)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="model weights and activations")
    p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="a Jinja chat template for a model whose tokenizer has none (e.g. the family's "
                        "chat_template.jinja); it replaces the tokenizer's own")


def _fleet_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", default="all", choices=["all", "indexer", "decoder"],
                   help="all: one node; indexer: builds jobs from Redis into the object store; "
                        "decoder: PutContext, Generate and admin, loading artifacts from the object store")
    p.add_argument("--object-store", default=None, metavar="URI",
                   help="the artifacts' copy of record, --data their local cache (indexer, decoder; optional "
                        "for all): s3://bucket/prefix?endpoint_override=host:port&scheme=http or file:///path")
    p.add_argument("--build-lease", type=float, default=10.0, metavar="SECONDS",
                   help="a build job whose indexer stopped beating this long is taken by another")
    p.add_argument("--heartbeat", type=float, default=2.0, metavar="SECONDS",
                   help="how often a decoder renews the contexts it holds hot (they expire after 3)")
    p.add_argument("--gc-interval", type=float, default=600.0, metavar="SECONDS",
                   help="indexers: collect the object store's garbage this often, one indexer of the fleet "
                        "at a time (expired contexts, objects nothing references); 0: never")
    p.add_argument("--gc-grace", type=float, default=3600.0, metavar="SECONDS",
                   help="an object nothing references is garbage only once this old (longer than any write)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ctxcache", description="context cache service for long LLM prompts")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gRPC service", formatter_class=DefaultsHelp)
    _service_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (a non-loopback one needs a token)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="gRPC port (0: one the OS picks, printed)")
    p.add_argument("--admin-port", type=int, default=None, help="serve admin + reflection here only")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics over HTTP (on --host)")
    p.add_argument("--http-port", type=int, default=None, help="also serve the OpenAI-compatible HTTP API "
                   "here (on --host; 0: a free port): /v1/chat/completions, /v1/cached_contents, ...")
    p.add_argument("--auto-cache-min-tokens", type=int, default=1024, help="HTTP: a missed chat's longest "
                   "leading messages (a completion's longest 128-token-aligned prefix) of at least this many tokens "
                   "become a context in the background")
    p.add_argument("--no-auto-cache", action="store_true", help="HTTP: never register missed prompts")
    p.add_argument("--grace", type=float, default=5.0, help="SIGTERM: seconds live streams get to finish")
    p.add_argument("--advertise", default="", help="host:port the registry records for this worker "
                   "(default: --host, or the hostname when binding all interfaces)")
    p.add_argument("--token", default=None, help="the admin bearer token (or env CTXCACHE_TOKEN)")
    p.add_argument("--tenant-tokens", default=None, help="TOKEN=TENANT,... (or env CTXCACHE_TENANT_TOKENS): "
                   "each token sees only its tenant's contexts")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without any token (e.g. behind a private network; "
                        "or env CTXCACHE_ALLOW_UNAUTHENTICATED=1)")
    p.add_argument("--no-access-log", action="store_true",
                   help="no access-log line per RPC (method, context id, status, duration) on stderr")
    p.add_argument("--warm-up-check", action=argparse.BooleanOptionalAction, default=True,
                   help="GPU: warm up first in a child process, so that a kernel compiler crash stops the start with "
                        "one line (a second model load; the server's own warm-up then compiles nothing)")
    p.add_argument("--tls-cert", type=Path, default=None, help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", type=Path, default=None, help="the certificate's private key (PEM)")
    _fleet_flags(p)

    p = sub.add_parser("put", help="cache a context")
    _client_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", type=Path, help="a UTF-8 text file")
    src.add_argument("--messages", type=Path, help='a JSON file: [{"role": ..., "content": ...}, ...]')
    src.add_argument("--documents", type=Path, help="a Parquet or Arrow file with a `text` column "
                     "(optional `id`, `title`)")
    p.add_argument("--label", action="append", default=[], help="key=value (repeatable)")
    p.add_argument("--ttl", type=int, default=0, help="seconds (0: none)")
    p.add_argument("--pin", action="store_true")
    p.add_argument("--method", default="", help="sparse method (default: the server's)")
    p.add_argument("--params", default="{}", help='method parameters as a JSON object, e.g. \'{"rerank": 1}\' '
                   "(without --method: over the server's default method's)")
    p.add_argument("--tenant", default="")
    p.add_argument("--no-wait", action="store_true", help="return while building")
    p.add_argument("--json", action="store_true", help="print the full context record, not just the id")
    p.add_argument("--kv-codec", default="", choices=["", "lossless", "int8", "int4"], help="default: the server's")
    p.add_argument("--keep-queries", action="store_true",
                   help="keep a prefill query sample so Rebuild with other CSAttention parameters needs no prefill")

    p = sub.add_parser("generate", help="ask a cached context; streams the answer")
    _client_flags(p)
    p.add_argument("context_id")
    p.add_argument("question")
    _sampling_flags(p)

    p = sub.add_parser("admin", help="operator commands")
    _client_flags(p)
    asub = p.add_subparsers(dest="admin_command", required=True)
    lp = asub.add_parser("list", help="every context, BUILDING ones included, with its state")
    lp.add_argument("--page-size", type=int, default=100)
    for name in ("show", "describe", "verify"):
        asub.add_parser(name).add_argument("context_id", nargs="?" if name == "verify" else None, default="")
    asub.choices["verify"].add_argument("--repair", action="store_true",
                                        help="a fleet: mark each damaged context DAMAGED (a Put of its content "
                                             "then rebuilds it)")
    ep = asub.add_parser("evict")
    ep.add_argument("context_id")
    where = ep.add_mutually_exclusive_group()
    where.add_argument("--memory-only", action="store_true", help="from DRAM and the device; the store keeps it")
    where.add_argument("--device-only", action="store_true", help="release its device slots; DRAM keeps it")
    where.add_argument("--local-only", action="store_true",
                       help="this worker's copies (device, DRAM, local store); the object store keeps it")
    rp = asub.add_parser("rebuild", help="re-index a stored context; without --method or --params it converts "
                         "the artifact to the current format (service/README.md)")
    rp.add_argument("context_id")
    rp.add_argument("--method", default="", help="another method (default: the context's own)")
    rp.add_argument("--params", default="{}", help="method parameters as a JSON object (over the context's own "
                    "when --method is not given)")
    rp.add_argument("--allow-reprefill", action="store_true",
                    help="prefill the stored tokens again when the method needs queries the context did not keep")
    asub.add_parser("stats")
    asub.add_parser("reconcile")

    p = sub.add_parser("health", help="exit 0 when the server's health service says SERVING")
    _client_flags(p)

    p = sub.add_parser("demo", help="start the service in-process, cache a bundled text, ask it")
    p.add_argument("--data", type=Path, default=None, help="store folder (default: a temp dir)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--method", default="csattention")
    p.add_argument("--question", default=None)
    p.add_argument("--max-tokens", type=positive_int, default=64)

    p = sub.add_parser("generate-local", help="no server: build the artifact in-process and answer on the "
                       "server's decode engine", formatter_class=DefaultsHelp)
    p.add_argument("--text", type=Path, required=True)
    p.add_argument("question")
    _model_flags(p)
    p.add_argument("--method", default="csattention")
    p.add_argument("--kv-codec", default="int8", choices=["lossless", "int8", "int4"],
                   help="K/V codec the context is held in, as the server stores it")
    p.add_argument("--schedule", default="0.05-step-1")
    _decode_mode_flag(p)
    _sampling_flags(p)

    p = sub.add_parser("bench", help="run a benchmark (bench --help lists them)")
    p.add_argument("name")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return ap


def _decode_mode_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-mode", default="auto", choices=["auto", "sparse", "dense"],
                   help="auto: sparse where it decodes faster, dense where not (per device and context length; "
                        "Final.decode_path and `admin stats` say which); dense: attend to every cached key")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")


def main(argv: list[str] | None = None) -> int:
    """Every failure is one line on stderr and a non-zero exit code (-v adds the traceback)."""
    argv = sys.argv[1:] if argv is None else argv
    verbose = "-v" in argv or "--verbose" in argv
    try:
        if argv[:1] == ["bench"]:  # the bench package parses everything after "bench" itself
            return _bench(argv[1:])
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        if args.command == "serve":  # one line per RPC unless switched off
            logging.getLogger("ctxcache.access").setLevel(logging.WARNING if args.no_access_log else logging.INFO)
        from ctxcache.service.cli import commands as cli_commands

        return int(cli_commands.run(args) or 0)
    except KeyboardInterrupt:
        print("ctxcache: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's one place that turns errors into a line
        if verbose:
            raise
        print(f"ctxcache: error: {one_line(exc)}", file=sys.stderr)
        return 1


def one_line(exc: BaseException) -> str:
    from ctxcache.service.cli.errors import describe

    return " ".join(describe(exc).split())[:500]


def _bench(argv: list[str]) -> int:
    """The bench subcommand runs the `ctxcache.commands` entry point named bench: the service
    knows no benchmark module (the benchmarks drive the service, not the reverse)."""
    found = [e for e in importlib.metadata.entry_points(group="ctxcache.commands") if e.name == "bench"]
    if not found:
        raise RuntimeError("the benchmarks are not installed here (pip install -e '.[bench]' from a checkout)")
    try:
        run = found[0].load()
    except ModuleNotFoundError as exc:
        raise RuntimeError(f"the benchmarks need their extra (pip install -e '.[bench]'): "
                           f"missing module {exc.name!r}") from exc
    return int(run(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
