"""The offload runner (K/V in host memory, a GPU slot cache of selected keys) against the
reference runner: same artifacts, same engine loop, same greedy tokens (a random fp32 model; on
CPU the Triton kernels run interpreted and "host" memory is plain CPU memory)."""

import pytest
import torch

from ctxcache.decoder.engine import Engine
from ctxcache.decoder.gpu.offload_runner import OffloadRunner
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.decoder.runner import ReferenceRunner
from ctxcache.generation import SamplingParams
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.methods import Budget, make_method
from ctxcache.models.loader import load_model

CONFIG = SparseConfig(Budget(0.1, 2, 8))
STEPS = 48 if torch.cuda.is_available() else 4
# interpreted on a CPU each case takes 50-75 s of CI's 2 cores: rerank 4 runs on a GPU and with -m slow
CPU_SLOW = () if torch.cuda.is_available() else (pytest.mark.slow,)


@pytest.mark.parametrize("rerank", [1.0, pytest.param(4.0, marks=CPU_SLOW)])
def test_offload_runner_decodes_the_reference_tokens(rerank, device):
    cpu_lm = load_model("random:tiny", seed=3)
    lm = load_model("random:tiny", seed=3, device="cuda" if torch.cuda.is_available() else "cpu")
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": rerank})
    cfg = IndexerConfig(kv_dtype="float32", progress=False)
    arts = [build_artifact(cpu_lm, torch.randint(0, lm.args.vocab_size, (n,), generator=torch.Generator().manual_seed(n)),
                           method, cfg) for n in (200, 150)]
    prompts = [[5, 6, 7], []]
    ref, off = Engine(ReferenceRunner(lm)), Engine(OffloadRunner(lm, method.params, CONFIG))
    try:
        want = [[t for t, _ in ref.start("x", a, p, CONFIG, SamplingParams(max_tokens=STEPS)).tokens(lambda: None)]
                for a, p in zip(arts, prompts)]
        seqs = [off.start(f"c{i}", a, p, CONFIG, SamplingParams(max_tokens=STEPS)) for i, (a, p) in enumerate(zip(arts, prompts))]
        got = [[t for t, _ in s.tokens(lambda: None)] for s in seqs]
    finally:
        off.close()
        ref.close()
    assert got == want
    hits, selected = off.runner.offload_hits()
    assert selected > 0 and 0 <= hits <= selected  # the slot caches saw every selected key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: compiles the bf16 kernels")
def test_offload_runner_serves_a_bf16_model_at_an_unaligned_length():
    """A bf16 model (16-bit re-rank keys) of SmolLM2's shapes and a context + question + answer of
    no round length: the kernels compile and the stream decodes (an unaligned cache length once
    broke the compiler at Llama-3.1-8B shapes and took the server down)."""
    lm = load_model("random:smollm2-135m", seed=3, dtype=torch.bfloat16, device="cuda")
    method = make_method("csattention", {"subspaces": 4, "centroids": 16})
    art = build_artifact(lm, torch.randint(0, lm.args.vocab_size, (333,), generator=torch.Generator().manual_seed(1)),
                         method, IndexerConfig(kv_dtype="bfloat16", progress=False))
    eng = Engine(OffloadRunner(lm, method.params, CONFIG))
    try:
        seq = eng.start("c", art, [5, 6, 7], CONFIG, SamplingParams(max_tokens=7))
        assert len([t for t, _ in seq.tokens(lambda: None)]) == 7
    finally:
        eng.close()
