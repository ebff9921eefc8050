"""Content-addressed context ids.

`context_id_for` is sha256 over a domain tag, a canonical JSON header and the token ids:

    sha256( b"ctxcache:v1:context\\0"
          + json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False) + b"\\0"
          + token ids as little-endian int64 )

header = {model_id, tokenizer_id, template_id, kv_dtype, kv_codec, format_version, method,
params, tenant, n_tokens}. The hex digest is stable across processes, machines and Python versions
(no hash randomisation, fixed byte order); any change of one field gives another id, so the
same context always maps to the same id and nothing else does. No torch here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_TAG = b"ctxcache:v1:context\0"


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace; NaN/inf rejected (they have no stable text)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def context_id_for(model_id: str, tokenizer_id: str, template_id: str, kv_dtype: str,
                   format_version: int, method: str, params: Mapping[str, Any],
                   token_ids: Sequence[int] | np.ndarray, tenant: str = "", kv_codec: str = "lossless") -> str:
    """sha256 hex (64 chars) identifying one context; see the module docstring."""
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise ValueError(f"token_ids must be a 1-D sequence of ints, got shape {tokens.shape} "
                         f"dtype {tokens.dtype}")
    header = {"model_id": model_id, "tokenizer_id": tokenizer_id, "template_id": template_id,
              "kv_dtype": kv_dtype, "kv_codec": kv_codec, "format_version": int(format_version), "method": method,
              "params": dict(params), "tenant": tenant, "n_tokens": int(tokens.size)}
    h = hashlib.sha256(_TAG)
    h.update(canonical_json(header).encode())
    h.update(b"\0")
    h.update(tokens.astype("<i8", copy=False).tobytes())
    return h.hexdigest()
