"""The released recipe's console summary and ``report.md`` tables (held-out KL, hinge, Top-B recall, memory)."""

from __future__ import annotations


def format_summary(summary: dict) -> str:
    lines = ["CORE, released recipe — online distillation (held-out documents)"]
    for tag, r in summary["eval"].items():
        line = f"  {tag}: KL {r['kl']:.4f}, hinge {r['hinge']:.4f}, Top-B recall {100 * r['topb_recall']:.1f}%"
        if "memory_relative" in r:
            line += (f"; memory MSE {r['memory_mse']:.4g} vs retained-only {r['retained_mse']:.4g} "
                     f"(x{r['memory_relative']:.3f}), gate {r['gate']:.3f}")  # fmt: skip
        lines.append(line)
    lines.append(f"  artifact: {summary['artifact']}  ({summary['wall_s']:.0f} s)")
    return "\n".join(lines)


def report_markdown(summary: dict) -> str:
    """The summary as markdown tables (``<out_dir>/report.md``)."""
    lines = ["| ratio | docs | KL(π_T ‖ softmax s) | hinge | Top-B recall | memory MSE | retained-only MSE | "
             "ratio | gate | α_E |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for tag, r in summary["eval"].items():
        mem = (f"{r['memory_mse']:.4g} | {r['retained_mse']:.4g} | {r['memory_relative']:.3f} | {r['gate']:.3f} | "
               f"{r.get('alpha_e', float('nan')):.3f}" if "memory_relative" in r else "– | – | – | – | –")  # fmt: skip
        lines.append(f"| {tag[1:]}% | {r['docs']} | {r['kl']:.4f} | {r['hinge']:.4f} | "
                     f"{100 * r['topb_recall']:.1f}% | {mem} |")  # fmt: skip
    for tag, r in summary["eval"].items():
        per_layer = {int(k): v for k, v in (r.get("memory_relative_layers") or {}).items()}
        if per_layer:
            helps = [i for i, v in sorted(per_layer.items()) if v < 1]
            lines.append(
                f"\n{tag[1:]}%: memory / retained-only error per layer: "
                + " ".join(f"{i}:{v:.3f}" for i, v in sorted(per_layer.items()))
                + f" (below 1 in layers {helps or 'none'})"
            )
    lines += ["", "| pass | part | seconds | share |", "|---|---|---|---|"]
    for name, t in summary["timing"].items():
        if isinstance(t, dict) and "seconds" in t:
            for k, v in t["seconds"].items():
                lines.append(f"| {name} | {k} | {v:.2f} | {100 * t['share'][k]:.1f}% |")
    return "\n".join(lines) + "\n"


__all__ = ["format_summary", "report_markdown"]
