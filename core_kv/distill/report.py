"""The distillation run's reports: the console summary and ``<out_dir>/report.md`` (the tables of
``research/notebook.md``)."""

from __future__ import annotations

from pathlib import Path

from core_kv.models.loading import PROXY_PATH

SYMBOLS = [
    ("held-out", "documents no teacher run and no training step saw (indices 2,000,000+)"),
    ("p*, s", "p* = the teacher's allocation over the cached tokens; s = the student's (indexer's) scores"),
    (
        "KL(p* ‖ softmax s)",
        "how far the student's distribution is from p* (lower is better), on the student's own "
        "retained sets and on the full cache (the teacher's protocol)",
    ),
    ("Top-B overlap", "share of the teacher's Top-B picks (protected tokens excluded) that the student also keeps"),
    (
        "α, ε̂",
        "α = the attention mass the evicted tokens truly had; ε̂ = the student's estimate of it; |α − ε̂| is "
        "the calibration error at T = 1 and with the fitted per-layer temperatures T_l (lower is better)",
    ),
    (
        "rel. err.",
        "‖o − o*‖² / ‖o*‖², the attention output's error with the retained tokens only and with the "
        "latent memory's readout added (the memory should lower it); |g − α| = the memory gate g against α",
    ),
    (
        "U_B, C_B, J_B",
        "Table 7 quality of a retained set of B tokens: U_B = utility kept (the future queries' "
        "attention mass on it), C_B = coverage (log-det of its keys' features), J_B = U_B + C_B, the teacher's "
        "objective; selectors: utility = Top-B of the utility alone, student, teacher = Top-B of p*, greedy = J_B's "
        "greedy maximiser; J_B / teacher near 100% means the student keeps what the teacher would",
    ),
]
"""The symbols the reports print, explained once (also in docs/train-your-model.md, "Read the report")."""


def symbols_legend(markdown: bool = False) -> str:
    """:data:`SYMBOLS` as console lines, or as a markdown list for ``report.md``."""
    if markdown:
        return "\n".join(["Symbols (docs/train-your-model.md, \"Read the report\"):", "",
                          *(f"- **{k}**: {v}" for k, v in SYMBOLS)]) + "\n"  # fmt: skip
    return "\n".join(["  what the numbers mean (docs/train-your-model.md, \"Read the report\"):",
                      *(f"    {k}: {v}" for k, v in SYMBOLS)])  # fmt: skip


def next_steps(model: str, artifact: str, out_dir: str) -> str:
    """Where the artifact and the report went and the two commands that load and evaluate it. The load command
    answers a needle question with the full cache and with CORE at 75% removal, side by side, so a reader sees
    whether CORE kept what the model needs; for the proxy LM (which answers it with neither) the line says so."""
    name = Path(out_dir).name
    load = (
        '.venv/bin/python -c "from core_kv.models.loading import load_model; from core_kv.presses import build_press; '
        f"from core_kv.pipeline import answer_questions; model, tok = load_model('{model}'); "
        f"press = build_press('core', checkpoint='{artifact}', compression_ratio=0.75); "
        "ctx = 'The grass is green. ' * 150 + 'The secret code is 4242. ' + 'The sky is blue. ' * 150; "
        "q = ['What is the secret code?']; full = answer_questions(model, tok, ctx, q, max_new_tokens=16); "
        "out = answer_questions(model, tok, ctx, q, press=press, max_new_tokens=16); "
        "print('full cache:', full['answers'], '| CORE at 75%:', out['answers'], '| KV bytes kept:', "
        "out['kv_bytes']['total'], 'of', full['kv_bytes']['total'], '| CORE memory bytes:', out['aux_bytes'])\""
    )
    check = "compress a context with CORE and answer, beside the full cache's answer (4242 is right)"
    if Path(model).name == PROXY_PATH.name:
        check = ("the proxy LM answers this needle with neither cache, so this only shows that the pipeline runs; "
                 "an answer you can read: docs/train-your-model.md")  # fmt: skip
    evaluate = (
        f'make eval ARGS="model.name={model} methods=[core,keydiff,snapkv,streaming_llm] '
        f'press_options.core.checkpoint={artifact} benchmarks=[ruler] output_dir=results/{name}"'
    )
    return "\n".join([
        f"artifact: {artifact}   report: {Path(out_dir) / 'report.md'}",
        "next:",
        f"  load it ({check}):\n    {load}",
        f"  evaluate it against the presses (RULER 1k, 75% removal; docs/evaluation.md):\n    {evaluate}",
    ])  # fmt: skip


def format_summary(summary: dict) -> str:
    lines = ["CORE stage 2 — distillation, calibration, memory (held-out documents)", symbols_legend()]
    for tag, r in summary["eval"].items():
        lines.append(
            f"  {tag}: KL {r['kl_student_candidates']:.4f} (student cands) / {r['kl_full_candidates']:.4f} (full); "
            f"Top-B overlap {100 * r['topb_overlap_student_candidates']:.1f}% / {100 * r['topb_overlap_full_candidates']:.1f}%"
        )
        lines.append(
            f"        |α − ε̂| {r['calibration_error_T1']:.4f} (T=1) -> {r['calibration_error_T']:.4f} (calibrated); "
            f"rel. err. retained-only {r['retained_only_rel_err']:.4f} -> with memory {r['memory_rel_err']:.4f}"
        )
        for name, v in r["table7"].items():
            lines.append(f"        Table 7 {name:>8}: U_B {v['U_B']:.4f}  C_B {v['C_B']:.4f}  J_B {v['J_B']:.4f}")
    dp = summary["timing"].get("deployment_parts")
    if dp:
        lines.append(
            "  time per document (press-like pass): "
            + ", ".join(f"{k} {100 * v:.1f}%" for k, v in dp["share"].items())
            + f"; outside the base forward {100 * dp['outside_base_forward']:.1f}%"
        )
    lines.append(f"  artifact: {summary['artifact']}  ({summary['wall_s']:.0f} s)")
    return "\n".join(lines)


def distill_report_markdown(summary: dict) -> str:
    """The summary as the markdown tables of ``research/notebook.md`` (also written to ``<out_dir>/report.md``)."""
    ev, lines = summary["eval"], [symbols_legend(markdown=True)]
    lines += ["| ratio | candidates | KL(p* ‖ softmax s) | Top-B overlap (free picks) |", "|---|---|---|---|"]
    for tag, r in ev.items():
        for pol, name in (("student", "student's own retained sets"), ("full", "full cache (teacher protocol)")):
            lines.append(f"| {tag[1:]}% | {name} | {r[f'kl_{pol}_candidates']:.4f} | "
                         f"{100 * r[f'topb_overlap_{pol}_candidates']:.1f}% |")  # fmt: skip
    lines += ["", "| ratio | selector | U_B | C_B | J_B | J_B / teacher |", "|---|---|---|---|---|---|"]
    for tag, r in ev.items():
        t7 = r["table7"]
        ref = t7.get("teacher", {}).get("J_B", float("nan"))
        for name in ("utility", "student", "teacher", "greedy"):
            if name in t7:
                v = t7[name]
                lines.append(f"| {tag[1:]}% | {name} | {v['U_B']:.4f} | {v['C_B']:.4f} | {v['J_B']:.4f} | "
                             f"{100 * v['J_B'] / ref:.2f}% |")  # fmt: skip
    cal = summary["calibration"]
    lines += ["", f"Temperatures T_l: {', '.join(f'{t:.3f}' for t in cal['temperature'])} "
              f"(fit on {cal['docs']} held-out documents; mean |α − ε̂| {cal['before']:.4f} → {cal['after']:.4f}).", ""]  # fmt: skip
    lines += ["| ratio | mean α | \|α − ε̂\| at T = 1 | at T_l | rel. error retained-only | with memory | "
              "\|g − α\| |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for tag, r in ev.items():
        lines.append(f"| {tag[1:]}% | {r['mean_true_evicted_mass']:.4f} | {r['calibration_error_T1']:.4f} | "
                     f"{r['calibration_error_T']:.4f} | {r['retained_only_rel_err']:.4f} | {r['memory_rel_err']:.4f} | "
                     f"{r['gate_abs_err_vs_alpha']:.4f} |")  # fmt: skip
    lines += ["", "| pass | part | seconds | share |", "|---|---|---|---|"]
    tm = summary["timing"]
    for name in ("deployment_parts", "indexer", "memory"):
        if name in tm:
            for k, v in tm[name]["seconds"].items():
                lines.append(f"| {name} | {k} | {v:.2f} | {100 * tm[name]['share'][k]:.1f}% |")
    return "\n".join(lines) + "\n"
