"""Tokenizers from local files, packing, and training shards."""
