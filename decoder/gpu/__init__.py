"""GPU fast path for sparse decode: Triton selection + split-K attention, graph-captured steps."""
