"""Coded K/V: the store hands back codes and scales, decoded where the context decodes; the
indexer encodes where the build ran. Every path must give the host codec's bits: on the CPU the
same functions run on CPU tensors; the `gpu` tests run them on CUDA and compare bit for bit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.decoder import SparseConfig
from ctxcache.decoder.session import start_batch
from ctxcache.indexer import IndexerConfig, build_artifact
from ctxcache.kv_codec import CodedKV, decode_kv, encode_kv
from ctxcache.methods import Budget, make_method
from ctxcache.models.loader import load_model
from ctxcache.decoder.cached_context import CachedContext
from ctxcache.store import ArtifactStore, StoreConfig
from store_helpers import make_artifact

CFG = StoreConfig(map_size_bytes=1 << 27, budget_bytes=1 << 27)
LOSSY = ["int8", "int4"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype.is_floating_point else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a.cpu()), bits(b.cpu()))


def host_decoded(parts: dict[str, torch.Tensor], codec: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What the store's get returned before: the host codec's decode of the stored chunks."""
    return decode_kv({n: t.clone() for n, t in parts.items()}, codec, dtype)


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("n", [128, 200])  # whole and partial key / int4 groups
def test_store_hands_back_codes_that_decode_to_the_host_codecs_bits(tmp_path: Path, codec: str, n: int) -> None:
    art = make_artifact(n=n, d=64)
    with ArtifactStore(tmp_path, CFG) as s:
        s.put("c", replace(art, kv_codec=codec))
        got = s.get("c")
    for src, layer in zip(art.layers, got.layers):
        assert layer.coded is not None and layer.coded.codec == codec and layer.kv_shape == tuple(src.k.shape)
        want = host_decoded(dict(encode_kv(src.k, src.v, codec)), codec, torch.float16)
        for dtype in (torch.float16, torch.float32):  # the artifact's dtype and a CPU cache's
            k_out, v_out = torch.empty(layer.kv_shape, dtype=dtype), torch.empty(layer.kv_shape, dtype=dtype)
            layer.kv_into(k_out, v_out)
            assert same_bits(k_out, want[0].to(dtype)) and same_bits(v_out, want[1].to(dtype))
        assert layer._k is None  # kv_into keeps nothing decoded beside the codes
        assert same_bits(layer.k, want[0]) and same_bits(layer.v, want[1])


def test_a_coded_artifact_is_held_in_fewer_bytes(tmp_path: Path) -> None:
    art = make_artifact(n=256, d=64)
    with ArtifactStore(tmp_path, CFG) as s:
        s.put("plain", art)
        s.put("int8", replace(art, kv_codec="int8"))
        plain, coded = (CachedContext(s.get(c), ("system",), 0) for c in ("plain", "int8"))
    assert coded.artifact.kv_bytes() == plain.artifact.kv_bytes()  # the decoded size is reported as before
    assert coded.nbytes() - coded.artifact.table_bytes() < 0.55 * (plain.nbytes() - plain.artifact.table_bytes())


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny")


def _build(lm, codec: str, coded_kv: bool = True) -> ContextArtifact:
    method = make_method("csattention", {"subspaces": 4, "centroids": 8, "kmeans_iters": 2})
    ids = torch.randint(0, lm.args.vocab_size, (150,), generator=torch.Generator().manual_seed(0))
    return build_artifact(lm, ids, method, IndexerConfig(kv_codec=codec, progress=False, coded_kv=coded_kv))


@pytest.mark.parametrize("codec", LOSSY)
def test_indexer_encodes_at_build_what_the_host_codec_would_store(tiny, tmp_path: Path, codec: str) -> None:
    plain, coded = _build(tiny, "lossless"), _build(tiny, codec)
    with ArtifactStore(tmp_path, CFG) as s:
        m_host = s.put("host", replace(plain, kv_codec=codec))  # encoded by the store from decoded K/V
        m_built = s.put("built", coded)  # encoded by the indexer
    assert all(l.coded is None for l in _build(tiny, codec, coded_kv=False).layers)  # in memory: exact K/V
    for a, b in zip(plain.layers, coded.layers):
        assert b.coded is not None and b._k is None
        want = dict(encode_kv(a.k, a.v, codec))
        assert list(want) == list(b.coded.parts)
        assert all(same_bits(want[n], b.coded.parts[n]) for n in want)
    assert [(c.name, c.sha256) for c in m_host.chunks] == [(c.name, c.sha256) for c in m_built.chunks]


def test_reference_admit_from_codes_equals_admit_from_host_decoded_kv(tiny, tmp_path: Path) -> None:
    art = replace(_build(tiny, "lossless"), kv_codec="int8")
    with ArtifactStore(tmp_path, CFG) as s:
        s.put("c", art)
        coded, decoded = s.get("c"), host_decoded_artifact(s.get("c"))
    assert all(l.coded is None for l in decoded.layers)
    config, question = SparseConfig(Budget(0.2)), [5, 6, 7, 8]
    with torch.inference_mode():
        first_coded = start_batch(tiny, [coded], [question], config, 4)[0]
        first_host = start_batch(tiny, [decoded], [question], config, 4)[0]
    assert torch.equal(first_coded, first_host)
    assert all(l._k is None for l in coded.layers)  # admitting did not decode into the DRAM artifact


def host_decoded_artifact(art: ContextArtifact) -> ContextArtifact:
    """The artifact with its K/V decoded on the host (what the store's get returned before)."""
    return replace(art, layers=[LayerArtifact(k=l.k, v=l.v, tables=l.tables) for l in art.layers])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_pinned_loads_need_cuda(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pin_memory"):
        ArtifactStore(tmp_path, replace(CFG, pin_memory=True))


# ---- on a GPU: the same functions on CUDA tensors, compared bit for bit with the CPU's ---------

def _kv(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    k = (torch.randn(4, n, 128, generator=g) * torch.linspace(0.1, 8, 128)).to(dtype)
    return k, torch.randn(4, n, 128, generator=g).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_encode_and_decode_give_the_hosts_bits(codec: str, dtype: torch.dtype) -> None:
    k, v = _kv(1000, dtype)
    host = CodedKV.encode(k, v, codec)
    dev = CodedKV.encode(k.cuda(), v.cuda(), codec)
    assert all(same_bits(host.parts[n], dev.parts[n]) for n in host.parts)
    want = host.decode()
    got = host.map(lambda t: t.pin_memory()).decode("cuda")
    assert got[0].is_cuda and same_bits(got[0], want[0]) and same_bits(got[1], want[1])


@pytest.mark.gpu
def test_gpu_pinned_store_load_decodes_into_a_cuda_cache(tmp_path: Path) -> None:
    art = make_artifact(n=300, d=64)
    with ArtifactStore(tmp_path, replace(CFG, pin_memory=True)) as s:
        s.put("c", replace(art, kv_codec="int8"))
        got = s.get("c")
    layer = got.layers[0]
    assert all(t.is_pinned() for t in layer.coded.parts.values())
    k_out = torch.empty(layer.kv_shape, dtype=torch.bfloat16, device="cuda")
    v_out = torch.empty_like(k_out)
    layer.kv_into(k_out, v_out)
    want = layer.coded.decode()
    assert same_bits(k_out, want[0].to(torch.bfloat16)) and same_bits(v_out, want[1].to(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_pinned_arena_is_page_locked_for_its_exact_size_and_released() -> None:
    """Pinned arenas are an mmap registered with CUDA (not torch's power-of-two host blocks):
    their tensors are pinned, round-trip through async copies, and many arenas of an odd size
    come and go without the host memory they pinned staying behind."""
    import gc

    from ctxcache.store.arena import Arena

    specs = [(torch.int8, (3, 1000, 77)), (torch.float32, (5, 333))]
    for _ in range(3):
        arena = Arena(specs, huge_pages=False, pinned=True)
        a, b = arena.tensors
        assert a.is_pinned() and b.is_pinned()
        a.copy_(torch.randint(-100, 100, a.shape, dtype=torch.int8))
        b.copy_(torch.randn(b.shape))
        back = [t.to("cuda", non_blocking=True).cpu() for t in (a, b)]
        assert torch.equal(back[0], a) and torch.equal(back[1], b)
        del arena, a, b, back
        gc.collect()
