"""The offload runner with each host slot's K in HBM (stage 2): the batched step gives the logits
of K read from the host (stage 1) and the reference runner's tokens; a slot's K buffer is
overwritten by the next context loaded there and kept for the same context; the PCIe byte count
of a known step. On a CPU "HBM" and "host" are both CPU memory: the code paths are what differ."""

import pytest
import torch

from ctxcache.decoder.engine import Engine
from ctxcache.decoder.gpu.offload_k import k_buffer_bytes
from ctxcache.decoder.gpu.offload_runner import OffloadRunner
from ctxcache.decoder.reference_attention import SparseConfig
from ctxcache.decoder.runner import ReferenceRunner
from ctxcache.generation import SamplingParams
from ctxcache.methods import Budget, make_method
from ctxcache.models.loader import load_model
from test_offload_runner import CPU_SLOW, _artifacts
from test_offload_v_runner import coded_artifacts

CONFIG = SparseConfig(Budget(0.1, 2, 8))
pytestmark = pytest.mark.usefixtures("small_score_pad")  # kernels/conftest.py: why
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _decoded_k(art, layer):
    k = torch.empty(art.layers[layer].kv_shape)
    art.layers[layer].kv_into(k, torch.empty_like(k))
    return k


def test_k_in_hbm_steps_give_the_host_k_logits_and_the_reference_tokens():
    """Two streams (a re-rank of 2x candidates, so the re-rank reads K) step together three times
    with K in HBM and with K on the host: equal logits each step; and the tokens the reference
    runner decodes."""
    lm = load_model("random:tiny", seed=3, device=DEVICE)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 2.0})
    arts = _artifacts(method, (200, 150))
    prompts = ([5, 6, 7], [])
    runs = {}
    for k_hbm in (True, False):
        r = OffloadRunner(lm, method.params, CONFIG, slots=2, max_len=320, max_new=32, k_hbm=k_hbm)
        assert (r.k is not None) == k_hbm and (r.caches[0].k.shape[2] == 0) == k_hbm  # the cache holds V alone
        rows, toks = zip(*[(row, int(first.argmax())) for row, first in
                           (r.admit(f"c{i}", a, p, CONFIG, 16) for i, (a, p) in enumerate(zip(arts, prompts)))])
        logits = []
        for _ in range(3):
            logits.append(r.step(list(rows), list(toks)))
            toks = logits[-1].argmax(-1).tolist()
        runs[k_hbm] = logits
    for got, want in zip(runs[True], runs[False]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    ref = Engine(ReferenceRunner(lm))
    try:
        for i, (a, p) in enumerate(zip(arts, prompts)):
            want = [t for t, _ in ref.start("x", a, p, CONFIG, SamplingParams(max_tokens=4)).tokens(lambda: None)]
            assert want[1:] == [int(s[i].argmax()) for s in runs[True]]
    finally:
        ref.close()


def test_a_slots_k_buffer_is_kept_for_its_context_and_replaced_by_the_next():
    """Two host slots: a context streamed again keeps its K buffer (no load); a third context
    takes the least recently used slot, whose buffer then holds its K, the other slot's untouched."""
    lm = load_model("random:tiny", seed=3, device=DEVICE)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 1.0})
    arts = dict(zip("abc", _artifacts(method, (200, 150, 170))))
    r = OffloadRunner(lm, method.params, CONFIG, slots=2, max_len=320, max_new=32)
    for cid in "ab":
        r.release(r.admit(cid, arts[cid], [], CONFIG, 8)[0])
    row, first = r.admit("a", arts["a"], [5, 6], CONFIG, 8)  # a is hot: same slot, same buffer
    r.step([row], [int(first.argmax())])
    r.release(row)
    assert r.loads == 2 and row.index == 0
    kept_b = [k[1].clone() for k in r.k]
    row, _ = r.admit("c", arts["c"], [], CONFIG, 8)  # b was used least lately: its slot and buffer go to c
    assert r.loads == 3 and row.index == 1
    for layer in range(lm.args.n_layers):
        torch.testing.assert_close(r.k[layer][1, :, :170].cpu(), _decoded_k(arts["c"], layer), rtol=0, atol=0)
        torch.testing.assert_close(r.k[layer][0, :, :200].cpu(), _decoded_k(arts["a"], layer), rtol=0, atol=0)
        assert not torch.equal(r.k[layer][1], kept_b[layer])
    assert [s.context_id for s in r.slots] == ["a", "c"]


@pytest.mark.parametrize("k_hbm", [True, False])
def test_pcie_bytes_of_a_known_step(k_hbm):
    """One slot, a 150-key context, no prompt, one step: 151 keys, 2 sinks + 8 recent static rows,
    ceil(0.1 x 151) = 16 selected keys per KV head, all misses (the stream's caches start empty),
    the step's new key written back; 2 layers x 2 KV heads x 32 dims x 4 bytes (fp32) a row.
    K in HBM: V of 10 + 16 + 1 rows; K on the host: K and V of those, and the new key's K read by
    the index insert."""
    lm = load_model("random:tiny", seed=3, device=DEVICE)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 1.0})
    art = _artifacts(method, (150,))[0]
    # no graph: a capture runs the step twice more first (its warm-up), each counted (H200)
    r = OffloadRunner(lm, method.params, CONFIG, slots=1, max_len=320, max_new=32, k_hbm=k_hbm, use_graph=False)
    row, first = r.admit("c", art, [], CONFIG, 8)
    assert r.pcie_bytes() == (0, 0)
    r.step([row], [int(first.argmax())])
    row_bytes, heads_layers = 32 * 4, 2 * 2
    rows = 10 + 16 + 1 if k_hbm else 2 * (10 + 16 + 1) + 1
    assert r.pcie_bytes() == (rows * row_bytes * heads_layers, 1)
    assert r.offload_hits() == (0, 16 * heads_layers)
    # the next step's misses are what its caches did not hold: counted on the device
    before = r.pcie_bytes()[0]
    r.step([row], [5])
    hits, selected = r.offload_hits()
    misses = selected - hits - 16 * heads_layers
    static = (10 + 1) * heads_layers * (1 if k_hbm else 2) + (0 if k_hbm else heads_layers)
    assert r.pcie_bytes() == (before + (static + misses * (1 if k_hbm else 2)) * row_bytes, 2)


def test_k_buffers_that_do_not_fit_are_refused_in_one_line(monkeypatch):
    lm = load_model("random:tiny", seed=3)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 1.0})
    need = k_buffer_bytes(lm.args, 3, 512, 4)
    assert need == 2 * 3 * 2 * 512 * 32 * 4
    from ctxcache.decoder.gpu import offload_k
    monkeypatch.setattr(offload_k, "free_bytes", lambda device=None: need - 1)
    with pytest.raises(ValueError, match=r"3 host slots x 512 tokens need 0\.00 GiB of K.*--offload-k host") as err:
        offload_k.k_buffers(lm.args, 3, 512, torch.float32, torch.device("cuda"))
    offload_k.k_buffers(lm.args, 3, 512, torch.float32, torch.device("cpu"), beside_bytes=1 << 50)  # a CPU: no check
    assert "\n" not in str(err.value)
    OffloadRunner(lm, method.params, CONFIG, slots=3, max_len=512, k_hbm=False)  # no K buffers: nothing to fit


@pytest.mark.parametrize("v_int8", [False, pytest.param(True, marks=CPU_SLOW)])
def test_offloaded_greedy_tokens_equal_the_resident_ones(v_int8):
    """A random fp32 model (64 greedy tokens on a GPU): two contexts with questions, the second
    admitted while the first decodes, from the resident fast runner and from the offload runner
    with K in HBM, each in one batched step, with the default re-rank (4x candidates, follow).
    fp32: on random Llama-3.1-8B in bf16 the fast runner's own logits differ from the reference's
    by up to 2 (logit std 1.3) within 4 steps (H200), so no two paths agree on its greedy tokens.
    v_int8: int8-coded artifacts (fp16 K/V, as the service's), their V kept as codes in the host
    slots and decoded where read: the resident slot's bits, so its tokens."""
    from ctxcache.decoder.gpu.runner import GpuRunner
    steps = 64 if torch.cuda.is_available() else 4  # interpreted on a CPU: 4 steps, ~40 s
    lm = load_model("random:tiny", seed=3, device=DEVICE)
    method = make_method("csattention", {"subspaces": 4, "centroids": 16, "rerank": 4.0})
    arts = coded_artifacts(method, (200, 170), "float16") if v_int8 else _artifacts(method, (200, 170))
    prompts = ([11, 12, 13, 14, 15], [21, 22])
    tokens = {}
    for name, runner in (("resident", GpuRunner(lm, method.params, CONFIG, 2, 384, max_new=steps + 8)),
                         ("offloaded", OffloadRunner(lm, method.params, CONFIG, slots=2, max_len=384,
                                                     max_new=steps + 8, v_int8=v_int8))):
        eng = Engine(runner)
        try:
            seqs = [eng.start(f"c{i}", a, p, CONFIG, SamplingParams(max_tokens=steps))
                    for i, (a, p) in enumerate(zip(arts, prompts))]
            tokens[name] = [[t for t, _ in s.tokens(lambda: None)] for s in seqs]
        finally:
            eng.close()
    assert [len(t) for t in tokens["offloaded"]] == [steps, steps]
    assert tokens["offloaded"] == tokens["resident"]


def test_the_pcie_counter_takes_the_re_ranks_candidates_from_the_method():
    """K on the host: a step's re-rank reads its candidates' K over PCIe, CSAttention.search_reads
    of them (with reselect 2 the mean of a selecting and a carried step); no re-rank, none."""
    from ctxcache.decoder.gpu.offload_k import PcieCounter
    from ctxcache.methods.csattention import CSAttention, CSAttentionParams

    budget, n = Budget(0.1, 2, 8), 1000
    lo, hi = budget.region(n)
    top = budget.top_k(n)

    def host(candidates):
        c = PcieCounter(64, 2, budget, candidates, 3, 0, k_hbm=False)
        c.step([n])
        return c.host
    without = host(None)
    for reselect in (1, 2):
        reads = CSAttention(CSAttentionParams(reselect=reselect)).search_reads
        assert host(reads) - without == 3 * reads(top, hi - lo) * 64 * 2
    assert CSAttention(CSAttentionParams(reselect=2)).search_reads(top, hi - lo) < 4 * top
