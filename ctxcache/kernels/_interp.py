"""Compatibility fix for Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) with numpy >= 2.4.

The interpreter keeps scalars as 1-element arrays and converts them for `range()` with
`int(array)`, which numpy 2.4+ rejects for arrays of ndim > 0. Loop bounds that come from
loaded lengths (dynamic trip counts, as the split-K attention needs) then fail on CPU only.
The patch reads the single element instead; compiled GPU code is untouched."""

from __future__ import annotations

import os


def patch_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_ctxcache_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._ctxcache_patched = True
    interpreter._patch_lang_tensor = patched
