"""This machine's copy of the artifacts in LMDB: the ArtifactStore (one manifest + its chunks per
transaction), LMDB's data file checked against the pages it may read, and the operations inside
one transaction."""
