"""Where a press-like pass spends its time: the frozen base forward vs features vs indexer vs memory.

:func:`profile` replays one held-out document the way the press runs it (no teacher targets) under the ``deploy``
timer; :func:`timing` turns the run's timers into the ``timing`` part of ``summary.json``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from core_kv.distill.context import RunContext
from core_kv.distill.replay import Timer, replay_layer, segment_attention
from core_kv.memory import write_weights


@torch.no_grad()
def profile(tr: RunContext, doc, ratio: float) -> None:
    """Time what the press does per document: base forward, features, indexer, memory writes + readout.

    Teacher targets and the reference attention outputs are not timed (training/evaluation only); the
    retained attention ``o_R``/``lse_R`` is computed outside the timer (the attention kernel gives it).
    """
    ctx = tr.context("deploy")
    idx, mem = tr.core.indexer, tr.core.memory
    spec = replace(tr.spec, ratio=ratio, policy="student", targets=False, utility=False)
    acts = ctx.acts(doc)
    for layer, a in enumerate(acts):
        events = replay_layer(a, layer, ctx.times(doc), doc.qa_start, tr.geometry, spec, idx.scores, ctx.timer)
        state = mem.empty_state(device=a.k_pre.device)
        heads = torch.arange(a.k_pre.shape[0], device=a.k_pre.device)[:, None]
        for ev in events:
            if ev.end <= ev.t_e:
                continue
            seg = segment_attention(a, ev)
            with ctx.timer("memory"):
                if ev.evicts:
                    w = write_weights(idx.distribution(layer, ev.scores), ~ev.kept, tr.cfg.write_rule)
                    pos = ev.evicted_positions()
                    state = mem.write(state, layer, a.k_pre[heads, pos], a.v[heads, pos], w[~ev.kept].view_as(pos))
                mem.compensate(state, layer, seg["q_pre"], seg["o_ret"], seg["lse_ret"])


def timing(timers: dict[str, Timer]) -> dict:
    """Step-time breakdown (seconds and shares) of the on-policy indexer and memory stages, and deployment."""
    out = {}
    for name, t in timers.items():
        total = sum(t.seconds.values())
        if total:
            out[name] = {"seconds": dict(t.seconds), "share": {k: v / total for k, v in t.seconds.items()}}
    ev = timers.get("deploy")
    if ev:
        deploy = {k: ev.seconds.get(k, 0.0) for k in ("base_forward", "features", "indexer", "memory")}
        tot = sum(deploy.values())
        out["deployment_parts"] = {
            "seconds": deploy,
            "share": {k: v / tot for k, v in deploy.items()} if tot else {},
            "outside_base_forward": (tot - deploy["base_forward"]) / tot if tot else float("nan"),
            "note": "press-like pass per held-out document: frozen base forward vs features vs indexer vs memory",
        }
    return out
