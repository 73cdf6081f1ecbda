"""core_kv: CORE, a learned KV-cache compressor, and a fair harness against training-free presses.

Shape legend used in comments throughout the package:
    B   batch size                      T   tokens in the current forward (query length)
    S   tokens in the KV cache          N   context length before compression
    H   query heads                     Hkv key/value heads (GQA: H = G * Hkv)
    G   query heads per KV head         D   head dimension
"""

__version__ = "0.1.0"
