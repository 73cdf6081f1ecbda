"""Why the released memory's gate closes: the readout's scale and direction against what it should reconstruct.

For held-out training documents (the recipe's own data, indices 2,100,000+, never evaluation contexts), per layer:
the prompt is compressed at ``--ratio`` (sinks kept; the evicted set is drawn by ``--evict``), the evicted tokens are
written to an empty fast memory (:mod:`research.released.memory`, conditional weights of a uniform distribution, or of the
artifact's student when ``--artifact`` is given), and for the memory's 16 tail queries we compare

- ``‖m(q)‖ / ‖o_E(q)‖``: the readout's norm over the norm of the attention output over the evicted keys alone (what a
  normalised summary of evicted values should approach),
- ``cos(m − o_R, o* − o_R)``: whether the interpolated correction points the right way,
- the best fixed gate for each readout form and the relative error it leaves (``min_g ‖gap − g c‖² / ‖gap‖² =
  1 − cos²(c, gap)``), with ``c = m`` (the release's residual) or ``c = m − o_R`` (the paper's interpolation);
  and the same with ``c = o_E − o_R`` (the ideal memory, ``m = o_E``).

Run: ``python -m research.released.readout --config research/released/configs/smollm2.yaml --docs 2``
(``--artifact runs/core-smollm2-released/final`` for a trained θ and student; without it θ is the release's
initialisation, ``FastMemory.reset_parameters(seed)``). ``--kernel positive`` replaces the release's signed kernel
``(θq)·(θk)`` normalised by ``sqrt((θq)²·b)`` with a positive one, ``φ(x) = elu(θx) + 1``, normalised by its own mass
(``m = Σ p̄ κ(q,k) v / Σ p̄ κ(q,k)``, a convex combination of the evicted values: the latent memory's form,
:mod:`core_kv.memory`), with the same θ: what a positive kernel would start from, before any training.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import torch

from core_kv.config import load_config
from core_kv.distill.replay import capture
from core_kv.documents import make_docs
from core_kv.models.loading import load_from_spec
from research.released.config import ReleasedTrainConfig
from research.released.memory import FastMemory, read
from research.released.model import ReleasedModel
from research.released.trainer import EVAL_OFFSET, attention_rows, prompt_split


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-12)


@torch.no_grad()
def layer_stats(a, memory: FastMemory, layer: int, n: int, tail: int, ratio: float, sinks: int, gen, scores=None):
    """The diagnostics of one layer of one document (dict of floats, means over the tail queries)."""
    t_len = a.k_post.shape[1]
    b = max(sinks, math.floor(n * (1 - ratio) + 1e-9))
    ranked = torch.rand(n, generator=gen) if scores is None else scores.clone()
    ranked[:sinks] = float("inf")
    keep = torch.zeros(n, dtype=torch.bool)
    keep[ranked.topk(b).indices] = True
    evicted = ~keep
    qpos = torch.arange(t_len - tail, t_len)
    causal = torch.arange(t_len)[None, :] <= qpos[:, None]
    readable = torch.cat([keep, torch.ones(t_len - n, dtype=torch.bool)])
    gone = torch.cat([evicted, torch.zeros(t_len - n, dtype=torch.bool)])
    o_full, alpha = attention_rows(a, qpos, causal, share=gone)
    o_ret = attention_rows(a, qpos, causal & readable[None, :])
    o_ev = attention_rows(a, qpos, causal & gone[None, :])
    s = torch.zeros(n) if scores is None else scores
    state = memory.write_event(memory.empty_state(), layer, s, evicted, a.k_post[:, :n], a.v[:, :n])
    h, _, d = a.q_post.shape
    m = read(
        state,
        memory.theta[layer],
        a.q_post[:, qpos].transpose(0, 1).reshape(tail, h * d),
        memory.kv_heads,
        memory.kernel,
    )
    gap = o_full - o_ret
    out = {"alpha_e": float(alpha.mean()), "m_over_oE": float((m.norm(dim=-1) / o_ev.norm(dim=-1)).mean()),
           "cos_m_oE": float(_cos(m, o_ev).mean())}  # fmt: skip
    for name, c in (("residual", m), ("interpolate", m - o_ret), ("ideal", o_ev - o_ret)):
        g = ((gap * c).sum() / (c * c).sum().clamp_min(1e-12)).clamp(0, 1)  # best gate in [0, 1], one per layer
        out[f"{name}_gate"] = float(g)
        out[f"{name}_rel"] = float((gap - g * c).pow(2).sum() / gap.pow(2).sum().clamp_min(1e-12))
    return out


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="research/released/configs/smollm2.yaml")
    ap.add_argument("--artifact", default="", help="a released-recipe artifact (its θ and student); '' = init θ")
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--ratio", type=float, default=0.75)
    ap.add_argument("--seed", type=int, default=0, help="θ's initialisation seed (without --artifact)")
    ap.add_argument("--kernel", choices=("released", "positive"), default="released")
    args = ap.parse_args(argv)
    cfg = load_config(ReleasedTrainConfig, [args.config])
    o = cfg.released
    model, tok = load_from_spec(cfg.teacher.model, "cpu")
    data = replace(cfg.teacher.data, min_len=math.ceil(0.75 * o.schedule.short_len), max_len=o.schedule.short_len)
    docs = make_docs(data, [EVAL_OFFSET + i for i in range(args.docs)], tok)
    core = None
    if args.artifact:
        core = ReleasedModel.from_pretrained(args.artifact)
        memory = core.memory
    else:
        c = model.config
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        memory = FastMemory(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, hd, o.memory.dim,
                            o.memory.gate_hidden)  # fmt: skip
        memory.reset_parameters(args.seed)
    memory.kernel = args.kernel  # the same θ read through the chosen kernel (research.released.memory.read)
    rows: dict[int, list[dict]] = {}
    gen = torch.Generator().manual_seed(0)
    for doc in docs:
        ids = torch.tensor([doc.ids])
        acts = capture(model, ids)
        n, tail = prompt_split(doc, o.memory.tail, True)
        for layer, a in enumerate(acts):
            scores = None
            if core is not None:
                pos = torch.arange(n)
                scores = core.scores(layer, a.q_post[:, :n], a.k_post[:, :n], a.v[:, :n], pos, pos, n, a.scaling,
                                     token_ids=ids[0, :n])  # fmt: skip
            rows.setdefault(layer, []).append(
                layer_stats(a, memory, layer, n, tail, args.ratio, o.losses.sinks, gen, scores)
            )
    keys = list(next(iter(rows.values()))[0])
    print("| layer | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    means = {k: [] for k in keys}
    for layer, rs in rows.items():
        vals = {k: sum(r[k] for r in rs) / len(rs) for k in keys}
        for k in keys:
            means[k].append(vals[k])
        print(f"| {layer} | " + " | ".join(f"{vals[k]:.3f}" for k in keys) + " |")
    print("| mean | " + " | ".join(f"{sum(v) / len(v):.3f}" for v in means.values()) + " |")


if __name__ == "__main__":
    main()
