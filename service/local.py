"""`ctxcache generate-local`: no server, no store: build the artifact in-process (progress bars)
and answer with sparse decode, streaming to the terminal."""

from __future__ import annotations

import sys
import time

from ctxcache.decoder import SparseConfig, generate
from ctxcache.generation import SamplingParams
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import make_method
from ctxcache.models.loader import load_model
from ctxcache.service.prompting import ByteTokenizer, Prompter, text_messages
from ctxcache.service.textstream import TextStream


def generate_local(args) -> int:
    lm = load_model(args.model)
    prompter = Prompter(lm.tokenizer if lm.tokenizer is not None else ByteTokenizer())
    context = text_messages(args.text.read_text(encoding="utf-8"))
    tokens = prompter.context_tokens(context)
    art = build_artifact(lm, tokens, make_method(args.method), IndexerConfig(progress=True))
    turn = [{"role": "user", "content": args.question}]
    prompt = prompter.turn_tokens(context, turn)
    sampling = SamplingParams(args.temperature, args.top_p, args.max_tokens, prompter.stop_token_ids, args.seed)
    stream, t0, n = TextStream(prompter.tokenizer, tuple(args.stop)), time.perf_counter(), 0
    for tok, _ in generate(lm, [art], [prompt], sampling, SparseConfig.from_schedule(args.schedule)):
        n += 1
        if int(tok[0]) in sampling.stop_token_ids:
            break
        sys.stdout.write(stream.push(int(tok[0])))
        sys.stdout.flush()
        if stream.stopped:
            break
    sys.stdout.write(stream.flush() + "\n")
    print(f"[{len(tokens)} context tokens, {n} generated in {time.perf_counter() - t0:.2f}s]", file=sys.stderr)
    return 0
