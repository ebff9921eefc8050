"""Generate from cached artifacts: load KV into a cache, prefill the new prompt, decode sparsely."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ctxcache.artifact import ContextArtifact
from ctxcache.decoder.reference_attention import ReferenceSparseAttention, SparseConfig
from ctxcache.generation import SamplingParams, decode_n_tokens, prefill
from ctxcache.methods import SparseMethod, Tables, make_method
from ctxcache.models.loader import LoadedModel


class ArtifactMismatch(ValueError):
    """The artifact was built for another model or method than the one decoding it."""


def check_compatible(lm: LoadedModel, artifacts: list[ContextArtifact]) -> None:
    for a in artifacts:
        if a.model_id != lm.model_id:
            raise ArtifactMismatch(f"artifact built for model {a.model_id!r}, decoder runs {lm.model_id!r}")
        diff = lm.args.differences(a.model_args)
        if diff:
            raise ArtifactMismatch(f"artifact built for model {a.model_id!r} with other model args than the "
                                   f"decoder's: {'; '.join(diff)}")
    methods = {(a.method, repr(sorted(a.method_params.items()))) for a in artifacts}
    if len(methods) > 1:
        raise ArtifactMismatch(f"a batch must share one method and parameters, got {sorted(methods)}")


def restore_tables(method: SparseMethod, art: ContextArtifact, device: torch.device | str,
                   on_demand: bool = False, keys: list[torch.Tensor] | None = None) -> list[Tables]:
    """Each layer's full tables on `device` (where the model decodes): the stored state moved
    there and what the method derives from it and the keys computed there (SparseMethod.restore;
    on_demand: derived per step where the method can, as the reference path reads them).
    keys: the layers' keys already on `device` (a cache row: no second decode of coded K/V);
    any float dtype holding the artifact's values (the rows are summed in fp64)."""
    keys = keys if keys is not None else [l.k.to(device) for l in art.layers]
    return [method.restore({name: t.to(device) for name, t in l.tables.items()}, k, on_demand)
            for l, k in zip(art.layers, keys)]


def _exact_keys(cache, row: int, art: ContextArtifact) -> list[torch.Tensor] | None:
    """The row's cached keys when the cache holds the artifact's keys exactly (its dtype, or fp32,
    which holds fp16 and bf16 values): then the rows derive from them with no second decode;
    else None (restore reads the artifact's own keys, e.g. fp16 K/V in a bf16 cache)."""
    kv = getattr(torch, art.kv_dtype)
    if cache.k[0].dtype not in (kv, torch.float32):
        return None
    return [cache.k[i][row, :, :art.n_tokens] for i in range(len(art.layers))]


Restorer = Callable[[SparseMethod, ContextArtifact, torch.device, "list[torch.Tensor] | None"], list[Tables]]


def restore_on_demand(method: SparseMethod, art: ContextArtifact, device: torch.device,
                      keys: list[torch.Tensor] | None = None) -> list[Tables]:
    """What the reference path decodes from: restore_tables with per-step derived rows."""
    return restore_tables(method, art, device, True, keys)


def start_batch(lm: LoadedModel, artifacts: list[ContextArtifact], prompts: list[list[int]],
                config: SparseConfig, max_new_tokens: int,
                restore: Restorer = restore_on_demand) -> tuple[torch.Tensor, ReferenceSparseAttention, object]:
    """Load each artifact into its cache row and prefill its prompt. restore: each artifact's
    tables (read-only to the decode: a caller may hand every stream of a context the same ones).

    -> (first logits [B, V], the attention callable, the cache)."""
    if len(artifacts) != len(prompts) or not artifacts:
        raise ValueError(f"got {len(artifacts)} artifacts and {len(prompts)} prompts; need one each, >= 1")
    check_compatible(lm, artifacts)
    method = make_method(artifacts[0].method, artifacts[0].method_params)
    need = max(a.n_tokens + len(p) for a, p in zip(artifacts, prompts)) + max_new_tokens
    # every row is filled by load_row below, so skip the zero-fill of the whole cache
    cache = lm.model.new_cache(len(artifacts), max_len=min(need, lm.args.max_seq_len), uninitialized=True)
    states = []
    for row, a in enumerate(artifacts):
        # coded K/V are decoded into the cache on its device; the rows derive from the cached keys
        cache.fill_row(row, a.n_tokens, lambda i, k, v: a.layers[i].kv_into(k, v))
        states.append([method.open(t) for t in restore(method, a, cache.lengths.device, _exact_keys(cache, row, a))])
    attn = ReferenceSparseAttention(method, states, config)
    device = cache.lengths.device
    first = []
    for row, (a, prompt) in enumerate(zip(artifacts, prompts)):
        if prompt:
            first.append(prefill(lm.model, torch.tensor([prompt], device=device), cache.row(row),
                                 attn.row_view(row))[0])
        else:
            first.append(a.last_logits.to(device))
    return torch.stack(first), attn, cache


def generate(lm: LoadedModel, artifacts: list[ContextArtifact], prompts: list[list[int]],
             sampling: SamplingParams, config: SparseConfig = SparseConfig()) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (tokens [B], finished [B]) per decode step for a batch of cached contexts."""
    first, attn, cache = start_batch(lm, artifacts, prompts, config, sampling.max_tokens)
    yield from decode_n_tokens(lm.model, first, cache, attn, sampling)
