"""The proxy LM: a few-million-parameter Llama trained here to solve RULER needle tasks on CPU (its model card:
``checkpoints/proxy-lm/README.md``).

- :mod:`~core_kv.proxy.tokenizer`: the word-piece tokenizer, built offline from the training corpus.
- :mod:`~core_kv.proxy.data`: the synthetic needle documents (training and the teacher's documents) and held-out essays.
- :mod:`~core_kv.proxy.train`: the training loop, resume state and export
  (``python -m core_kv.proxy.train --config configs/proxy/default.yaml``).
- :mod:`~core_kv.proxy.evaluate`: RULER's own scoring of an exported proxy (``python -m core_kv.proxy.evaluate``).

The package is not the model adapter (:mod:`core_kv.models`, which every press relies on); a proxy checkpoint is a
plain Llama folder loaded like any other model. ``tokenizer``, ``data`` and ``train`` import only the floor
(:mod:`core_kv.models`, :mod:`core_kv.corpus`, config/io); ``evaluate`` uses RULER from :mod:`core_kv.eval` and sits
above it (``docs/architecture.md``).
"""
