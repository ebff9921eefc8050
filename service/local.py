"""`ctxcache generate-local`: no server, no store: build the artifact in-process (progress bars)
as a PutContext builds it, then answer on the server's decode path (GenerateStreams over the
runners `serve` would pick: the reference runner on a CPU, the fast runner on a GPU), so it
decodes at the server's speed, streaming to the terminal, and prints the same timings."""

from __future__ import annotations

import sys
import time

import torch

from ctxcache.generation import SamplingParams
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import make_method
from ctxcache.models.cpu_layout import usable_cores
from ctxcache.models.loader import load_model
from ctxcache.decoder.artifact_cache import ArtifactCache
from ctxcache.decoder.cached_context import CachedContext
from ctxcache.service.config import DecoderSettings, IndexerSettings, ModelConfig, ServiceConfig
from ctxcache.decoder.generate_streams import GenerateStreams
from ctxcache.decoder.stream_spec import Chunk, GenerateSpec
from ctxcache.metrics import Metrics
from ctxcache.prompting import ByteTokenizer, Prompter, ensure_chat_template, text_messages
from ctxcache.service.assembly import decode_runners

LOCAL_ID = "local"
KV_DTYPE = "float16"  # what the service's builds hold (BuildQueue)


def generate_local(args) -> int:
    model = ModelConfig(args.model, args.device, args.dtype)  # validates the dtype
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA GPU")
    torch.set_num_threads(usable_cores())  # as serve does
    lm = load_model(model.model, getattr(torch, model.dtype), model.device)
    if lm.tokenizer is not None:
        ensure_chat_template(lm.tokenizer, args.chat_template, model.model)
    prompter = Prompter(lm.tokenizer if lm.tokenizer is not None else ByteTokenizer())
    context = text_messages(args.text.read_text(encoding="utf-8"))
    tokens = prompter.context_tokens(context)
    t0 = time.perf_counter()
    art = build_artifact(lm, tokens, make_method(args.method),
                         IndexerConfig(kv_dtype=KV_DTYPE, kv_codec=args.kv_codec, progress=True, coded_kv=True))
    build_s = time.perf_counter() - t0
    turn = [{"role": "user", "content": args.question}]
    slot = art.n_tokens + len(prompter.turn_tokens(context, turn)) + args.max_tokens
    streams = _streams(lm, prompter, art, args, model, slot)
    spec = GenerateSpec(LOCAL_ID, turn, SamplingParams(args.temperature, args.top_p, args.max_tokens, (), args.seed),
                        tuple(args.stop), args.schedule)
    final = None
    for event in streams.stream(spec, lambda: True, None, time.perf_counter()):
        if isinstance(event, Chunk):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        else:
            final = event
    sys.stdout.write("\n")
    streams.close()
    print(f"[{len(tokens)} context tokens: prefill + index {build_s:.2f}s; ttft {final.ttft_seconds:.3f}s, "
          f"{final.tokens_per_second:.1f} tok/s, {final.generated_tokens} generated, {final.finish_reason}, "
          f"decoded by {final.decode_path}]", file=sys.stderr)
    return 0


def _streams(lm, prompter: Prompter, art, args, model: ModelConfig, slot: int) -> GenerateStreams:
    """The server's GenerateStreams over the one in-memory artifact: one stream, one GPU slot
    of `slot` tokens (context, question and answer)."""
    cfg = ServiceConfig(model=model, indexer=IndexerSettings(method=args.method),
                        decoder=DecoderSettings(schedule=args.schedule, gpu_slots=1, gpu_slot_tokens=slot,
                                                decode_mode=args.decode_mode))
    roles = tuple(m["role"] for m in text_messages(""))
    cache = ArtifactCache[CachedContext](1 << 62, lambda _: CachedContext(art, roles, 0), CachedContext.nbytes)
    return GenerateStreams(lm, prompter, cache, 1, args.schedule, Metrics(), decode_runners(lm, cfg),
                           decode_mode=args.decode_mode)
