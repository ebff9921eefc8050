"""ctxcache: context cache service for long, reusable LLM prompts.

`ctxcache` (this folder) holds what every component shares: the model, the
sparse-attention methods and the artifact schema. It imports no gRPC, Redis or LMDB.
"""

__version__ = "0.1.0"
