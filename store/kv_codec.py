"""The per-context K/V codecs live in `ctxcache.kv_codec` (torch only: the indexer encodes and the
decoders decode on their own devices); re-exported here for the store's layout."""

from ctxcache.kv_codec import INT4_GROUP, KEY_GROUP, MIN_SUFFIX, SCALE_SUFFIX, CodedKV, decode_kv, encode_kv

__all__ = ["INT4_GROUP", "KEY_GROUP", "MIN_SUFFIX", "SCALE_SUFFIX", "CodedKV", "decode_kv", "encode_kv"]
