"""Every layer's tables and slot caches as views of one (table_stacks.layer_tables, SlotCache.layers):
a row reset in every layer at once leaves exactly what a reset of that row layer by layer leaves,
and the other rows as they were (the offload runner's admission resets a row this way)."""

import torch

from ctxcache.decoder.gpu.offload import SlotCache
from ctxcache.decoder.gpu.table_stacks import layer_tables, row_of_every_layer

LAYERS, ROWS, HKV = 3, 4, 2
LIKE = {"centroids": torch.zeros(HKV, 2, 4, 8, dtype=torch.float16),
        "dense_score": torch.zeros(HKV, 2, 4, 40, dtype=torch.int8), "dense_scale": torch.zeros(HKV, 2, 4)}


def _scramble(tensors: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randint(-5, 100, t.shape, generator=gen).to(t.dtype))


def test_a_row_reset_in_every_layer_at_once_is_the_per_layer_reset():
    made = [layer_tables(LAYERS, ROWS, LIKE, 40, 8, "cpu", follow=3) for _ in range(2)]
    for (tables, _), seed in zip(made, (1, 1)):
        assert len(tables) == LAYERS and tables[0].follow_prev.shape == (ROWS, HKV, 3)
        for i, t in enumerate(tables):
            _scramble([t.n_ctx, t.stream_start, t.stream_count, t.follow_prev], seed + i)
    (per_layer, _), (_, whole) = made
    for t in per_layer:
        t.reset_stream(2)
    whole.reset_stream(row_of_every_layer(2, ROWS))
    for got, want in zip(made[1][0], per_layer):
        for name in ("n_ctx", "stream_start", "stream_count", "follow_prev"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert int(got.stream_count[2]) == 0 and int(got.stream_start[2]) == int(got.n_ctx[2])
        assert int(got.stream_count[1]) != 0  # other rows untouched (a scrambled count stays)


def test_a_slot_cache_row_cleared_in_every_layer_at_once_is_the_per_layer_clear():
    made = [SlotCache.layers(LAYERS, ROWS, HKV, 5, 30, 8, torch.float32, "cpu", keys=False) for _ in range(2)]
    for caches, _ in made:
        for i, c in enumerate(caches):
            busy, free, stamp, _ = c.scratch
            _scramble([c.tag, c.slot_of, busy, free, stamp, c.ring], 7 + i)
    (per_layer, _), (_, whole) = made
    for c in per_layer:
        c.clear_row(1)
    whole.clear_row(row_of_every_layer(1, ROWS))
    for got, want in zip(made[1][0], per_layer):
        for a, b in zip((got.tag, got.slot_of, got.ring, *got.scratch[:3]), (want.tag, want.slot_of, want.ring,
                                                                              *want.scratch[:3])):
            assert torch.equal(a, b)
        assert bool((got.tag[1] == -1).all()) and bool((got.tag[0] != -1).any())


def test_each_layer_keeps_its_own_counts():
    caches, _ = SlotCache.layers(LAYERS, ROWS, HKV, 5, 30, 8, torch.float32, "cpu")
    caches[0].hits += 3
    caches[1].selected += 2
    assert [(int(c.hits), int(c.selected)) for c in caches] == [(3, 0), (0, 2), (0, 0)]
    assert caches[0].scratch[3].data_ptr() == caches[0].hits.data_ptr()  # the kernels' counts are the same
