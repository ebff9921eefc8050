"""A prompt with no cached context (a miss): decoded as any server decodes it, the whole prompt
prefilled densely after an empty context, every step dense.

Why an empty artifact rather than a second decode path: the stream then runs exactly as a
cached one does (the same engine, batching, cancellation, stops and Final), with 0 cached
tokens. The "oracle" method keeps no index, so the empty context needs no build; with every
layer dense it is never asked to search.
"""

from __future__ import annotations

import torch

from ctxcache.artifact import ContextArtifact, LayerArtifact
from ctxcache.models.loader import LoadedModel
from ctxcache.decoder.cached_context import CachedContext

MISS = ""  # GenerateSpec.context_id of a prompt decoded with no cached context


def empty_context(lm: LoadedModel) -> CachedContext:
    a = lm.args
    empty = torch.zeros(a.n_kv_heads, 0, a.head_dim, dtype=torch.float16)
    art = ContextArtifact(model_id=lm.model_id, model_args=a.to_dict(), method="oracle", method_params={},
                          tokens=torch.zeros(0, dtype=torch.int64), last_logits=torch.zeros(a.vocab_size),
                          layers=[LayerArtifact(empty, empty) for _ in range(a.n_layers)])
    return CachedContext(art, (), 0)
