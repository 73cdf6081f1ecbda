"""The proxy LM: a few-million-parameter Llama trained here to solve RULER needle tasks on CPU (its model card:
``checkpoints/proxy-lm/README.md``).

- :mod:`~core_kv.proxy.tokenizer`: the word-piece tokenizer, built offline from the training corpus.
- :mod:`~core_kv.proxy.train`: the training loop, resume state and export
  (``python -m core_kv.proxy.train --config configs/proxy/default.yaml``).

Its training documents are :mod:`core_kv.documents` (the synthetic needle tasks every model's teacher also uses) and
the training split of :mod:`core_kv.corpus`; RULER's own scoring of an exported proxy is an evaluation,
:mod:`core_kv.eval.proxy_ruler` (``python -m core_kv.eval.proxy_ruler``). The package is not the model adapter
(:mod:`core_kv.models`, which every press relies on); a proxy checkpoint is a plain Llama folder loaded like any
other model, and nothing but its own tests and evaluation imports this package (``docs/architecture.md``).
"""
