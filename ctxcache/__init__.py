"""ctxcache: context cache service for long, reusable LLM prompts.

`ctxcache` (this folder) holds what every component shares: the model, the
sparse-attention methods and the artifact schema, and what the indexer, the decoder and the
fronts each use of a request: its prompt (prompting), its errors (errors: status names the
fronts map to gRPC and HTTP) and the instance's counters (metrics). It imports no gRPC, Redis
or LMDB.
"""

__version__ = "0.1.0"
