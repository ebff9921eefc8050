"""The shared object tier, the artifacts' copy of record: the ObjectArtifactStore, where a
context's objects live (layout, no I/O), the tier's budget, TTL and garbage collection, and its
configuration (no torch)."""
