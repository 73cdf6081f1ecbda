"""CORE stage 2–4 training: indexer distillation, temperature calibration, latent memory (``../shared/design/CORE.md``).

- :mod:`~core_kv.distill.config`: the typed :class:`TrainConfig` (YAML in ``configs/train/`` overrides it).
- :mod:`~core_kv.distill.replay`: activation capture and the per-layer chunked-prefill replay with real evictions.
- :mod:`~core_kv.distill.losses`: KL / Top-B boundary / memory losses, calibration fit and metrics.
- :mod:`~core_kv.distill.steps`: the trainable steps (teacher-record warm-up, on-policy replay, memory).
- :mod:`~core_kv.distill.loop`: the generic resumable stage loop (Accelerate accumulation, checkpoints, resume).
- :mod:`~core_kv.distill.stages`: the stages in order (indexer warm-up + on-policy indexer, calibration, memory).
- :mod:`~core_kv.distill.evaluate`, :mod:`~core_kv.distill.timing`, :mod:`~core_kv.distill.report`: held-out
  evaluation, the step-time breakdown, the console summary and ``report.md``.
- :mod:`~core_kv.distill.trainer`: ``train(cfg)``: the run's setup (base model, teacher data, CORE model), what a
  rerun keeps, the stages in order, the final artifact.

Shape legend: L layers, H query heads, Hkv KV heads, G = H/Hkv, D head dim, T tokens, N candidates at an event,
F = 14 features, P = 512 memory features.
"""
