"""The teacher run's summary: Table 5 residuals/agreement, Table 7 set quality and throughput, and its text report."""

from __future__ import annotations

import torch

from core_kv.teacher.config import TeacherConfig


def summarise(cfg: TeacherConfig, t: dict[str, torch.Tensor], times: dict, tokens: int, events: int, dims) -> dict:
    """Table 5, Table 7 and throughput from merged samples."""

    def stats(x):
        return {"median": float(x.median()), "p90": float(x.quantile(0.9)), "mean": float(x.mean()), "n": x.numel()}

    s = {k[2:]: v for k, v in t.items() if k.startswith("s.")}
    out: dict = {"model_layers": dims["layers"], "kv_heads": dims["kv_heads"]}
    if s:
        r0, rr = cfg.steps, cfg.ref_steps
        t5 = {
            "1": {"e_R": stats(s["e_1"])},
            str(r0): {"e_R": stats(s[f"e_{r0}"])},
            str(rr): {f"e_R_vs_{2 * rr}": stats(s[f"e_{rr}_vs_{2 * rr}"])},
        }
        for r in cfg.ratios:
            tag = f"r{round(100 * r)}"
            if f"overlap_1.{tag}" in s:
                t5["1"][f"overlap.{tag}"] = float(s[f"overlap_1.{tag}"].mean())
                t5[str(r0)][f"overlap.{tag}"] = float(s[f"overlap_{r0}.{tag}"].mean())
        out["table5"] = t5
        out["tv_pstar_piu"] = stats(s["tv_pstar_piu"])
        t7 = {}
        for r in cfg.ratios:
            tag = f"r{round(100 * r)}"
            rows = {}
            for name in ("utility", "teacher", "greedy"):
                if f"U.{tag}.{name}" in s:
                    u, c = s[f"U.{tag}.{name}"], s[f"C.{tag}.{name}"]
                    rows[name] = {"U_B": float(u.mean()), "C_B": float(c.mean()), "J_B": float((u + c).mean())}
            t7[tag] = rows
        out["table7"] = t7
    wall = times.get("_wall", 0.0)
    hooks = times.get("_in_hooks", 0.0)
    forward = times.get("_forward_total", 0.0) - hooks
    parts = {k: v for k, v in times.items() if not k.startswith("_")}
    production = forward + sum(v for k, v in parts.items() if k != "metrics")
    out["throughput"] = {
        "tokens": tokens,
        "events_x_layers": events,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else float("nan"),
        "tokens_per_s_per_layer": tokens * dims["layers"] / wall if wall else float("nan"),
        "tokens_per_s_without_metrics": tokens / production if production else float("nan"),
        "seconds": {"forward": forward, **parts},
        "share_without_metrics": {k: v / production for k, v in {"forward": forward, **parts}.items() if k != "metrics"}
        if production
        else {},
    }
    return out


def format_report(cfg: TeacherConfig, m: dict, model_name: str) -> str:
    lam = f"lambda={cfg.lam}" + (f" (per layer: {dict(cfg.lam_layers)})" if cfg.lam_layers else "")
    lines = [f"CORE teacher (stage 1) — model {model_name}, {lam}, eta={cfg.eta}, R0={cfg.steps}"]
    if "table5" in m:
        t5 = m["table5"]
        lines.append("Table 5 (residual e_R = 1/2|p^(R) - p^(16)|_1; Top-B agreement with R=16 on the free picks)")
        tags = [f"r{round(100 * r)}" for r in cfg.ratios]
        lines.append(
            f"  {'R':>4} {'median e_R':>12} {'P90 e_R':>12} " + " ".join(f"{'overlap@' + t:>12}" for t in tags)
        )
        for r in ("1", str(cfg.steps)):
            e = t5[r]["e_R"]
            ov = " ".join(f"{100 * t5[r].get('overlap.' + t, float('nan')):11.2f}%" for t in tags)
            lines.append(f"  {r:>4} {e['median']:12.3e} {e['p90']:12.3e} {ov}")
        e = t5[str(cfg.ref_steps)][f"e_R_vs_{2 * cfg.ref_steps}"]
        lines.append(f"  {cfg.ref_steps:>4} {e['median']:12.3e} {e['p90']:12.3e}   (vs R={2 * cfg.ref_steps}; ref.)")
        lines.append("Table 7 (U_B = kept utility mass, C_B = logdet coverage of the kept set, J_B = U_B + C_B)")
        for tag, rows in m["table7"].items():
            for name, v in sorted(rows.items(), key=lambda kv: ("utility", "teacher", "greedy").index(kv[0])):
                lines.append(f"  {tag:>4} {name:>8}  U_B {v['U_B']:.4f}  C_B {v['C_B']:.4f}  J_B {v['J_B']:.4f}")
        lines.append(
            f"TV(p*, pi_U): median {m['tv_pstar_piu']['median']:.4f}  (total variation between the teacher's "
            "allocation and the utility alone: how far coverage moved it)"
        )
    th = m["throughput"]
    lines.append(
        f"Throughput: {th['tokens']} tokens, {th['tokens_per_s']:.1f} tok/s, {th['tokens_per_s_per_layer']:.1f} "
        f"tok/s per layer (x layers), {th['tokens_per_s_without_metrics']:.1f} tok/s without the Table 5/7 metrics"
    )
    lines.append(
        "  time share without metrics: "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in th["share_without_metrics"].items())
    )
    return "\n".join(lines)
