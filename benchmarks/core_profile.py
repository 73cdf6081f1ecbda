"""Where CORE's online time goes: prefill and decode CPU time per component (issues 19, 48).

Runs one context through no compression and through CORE (one-shot or chunked prefill, then ``--steps``
single-token decode steps on the compressed cache) and times every component by wrapping the functions in
:data:`TARGETS` for the duration of the run (no instrumentation in the library, so production pays nothing). A
target that does not exist raises before anything runs, naming it: the table follows the code, it never silently
skips a component. A target the configuration does not call (e.g. head pooling under uniform budgets) is reported
as not called.

| component            | what                                                                          |
|----------------------|-------------------------------------------------------------------------------|
| q_hook, hooks        | queries from ``q_proj``; the attention pre/post hooks' bookkeeping               |
| unrope               | pre-RoPE keys of the candidates at an event                                    |
| feat_obs_attention   | the window queries' attention over the candidates                              |
| feat_geometry        | projected keys and Nyström coverage features (``Geometry.project/nystrom``)     |
| feat_novelty         | ridge leverage under uniform p                                                 |
| feat_twin_rarity     | spec v2's nonlocal twin counts                                                  |
| feat_key_distinct    | spec v2's KeyDiff score                                                         |
| feat_persistence     | the EMA across events                                                          |
| feat_other           | the rest of ``compute_features`` (norms, ages, prototype fit/entropy, ...)      |
| indexer              | indexer MLP scores + the calibrated distribution                               |
| selection            | protected set + Top-B                                                          |
| head_pooling         | AdaKV's head-wise allocation (``head_budgets="adaptive"``) or the head-shared mean (``"shared"``) |
| repair               | TwinKV's repair pass (``repair=True``)                                          |
| memory_write         | write weights + the memory write                                               |
| event                | the rest of an eviction event (ε̂, gathers, bookkeeping)                        |
| evict                | the physical eviction (gather into the new cache / ragged layer)               |
| readout_lse, readout_memory, readout | the readout: log-partition over the retained cache, m(q) and the gate, the rest |
| attention            | the model's attention on rectangular layers (the base implementation)          |
| ragged_attention     | attention on ragged layers (head-wise budgets)                                 |

Times are self times (a component's children are subtracted), CPU seconds, one thread. ``overhead`` = CORE's
total minus no compression's; what the components do not explain is the rest of the model (projections, MLPs,
norms), which the smaller cache does not change. ``--press-option NAME.OPTION=VALUE`` profiles CORE variants
(``NAME`` alone, e.g. ``pool.head_budgets=adaptive pool.head_pool=output pool.memory=false``) beside the
artifact's defaults. Usage::

    .venv/bin/python -m benchmarks.core_profile --model smollm2-135m --checkpoint checkpoints/core-smollm2/final \\
        --lengths 2048 4096 8192
    .venv/bin/python -m benchmarks.core_profile --shape llama-3.1-8b --layers 1 --lengths 4096 \\
        --checkpoint checkpoints/core-smollm2/final --ratio 0.5

With ``--shape`` and ``--checkpoint`` the artifact's feature spec and policy run on the config-built layers
(:func:`~benchmarks.core_cost.shape_artifact`); with ``--shape`` alone an untrained artifact (the paper's press).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import tempfile
import time
from collections import defaultdict
from functools import wraps
from pathlib import Path

import torch

from benchmarks.core_cost import add_model_args, bench_model, build_artifact, shape_artifact
from core_kv.eval.press_labels import parse_press_options

SCORER = "core_kv.presses.core_scorer.CoreScorerPress"
MEMORY = "core_kv.presses.latent_memory.LatentMemoryPress"
BASE = "core_kv.presses.base.BasePress"
INDEXER = "indexer"  # the press's indexer instance
ATTENTION = "attention"  # the base attention implementation registered with transformers
TARGETS = (  # (owner, attribute, component): the pieces of the composed press (core_kv/presses/core.py)
    (BASE, "_query_hook", "q_hook"),  # the one capture of q_proj per forward
    (BASE, "queries", "q_hook"),  # its conversion, once per forward, read by the scorer and the memory
    (BASE, "_pre_hook", "hooks"),
    (BASE, "_post_hook", "hooks"),
    (SCORER, "before_forward", "hooks"),
    (SCORER, "after_forward", "hooks"),
    (MEMORY, "before_forward", "hooks"),
    (MEMORY, "after_forward", "hooks"),
    (SCORER, "score", "event"),
    (SCORER, "evicted", "event"),
    (BASE, "_apply", "evict"),
    (SCORER, "unrope", "unrope"),
    (SCORER, "_features", "feat_other"),
    ("core_kv.presses.core_scorer", "observation_attention", "feat_obs_attention"),
    ("core_kv.presses.core_scorer", "compute_features", "feat_other"),
    ("core_kv.features", "twin_rarity", "feat_twin_rarity"),
    ("core_kv.features", "key_distinctiveness", "feat_key_distinct"),
    ("core_kv.features", "leverage", "feat_novelty"),
    ("core_kv.features", "normalised_beta_b", "feat_novelty"),
    ("core_kv.features", "update_persistence", "feat_persistence"),
    ("core_kv.geometry.Geometry", "project", "feat_geometry"),
    ("core_kv.geometry.Geometry", "nystrom", "feat_geometry"),
    (INDEXER, "scores", "indexer"),
    (INDEXER, "distribution", "indexer"),
    ("core_kv.presses.base.ScorerPress", "compress", "selection"),
    ("core_kv.presses.base.ScorerPress", "select", "selection"),
    ("core_kv.presses.adakv.AdaKVPress", "score", "head_pooling"),
    ("core_kv.presses.adakv.AdaKVPress", "select", "head_pooling"),
    ("core_kv.presses.adakv", "adaptive_keep", "head_pooling"),
    ("core_kv.presses.head_shared.HeadSharedPress", "score", "head_pooling"),
    ("core_kv.presses.twin_repair.TwinRepairPress", "compress", "repair"),
    (MEMORY, "evicted", "memory_write"),
    (MEMORY, "write", "memory_write"),
    (MEMORY, "write_weights", "memory_write"),
    ("core_kv.presses.latent_memory", "write_fused", "memory_write"),
    (MEMORY, "readout", "readout"),
    (MEMORY, "retained_lse", "readout_lse"),
    (MEMORY, "compensate", "readout_memory"),
    ("core_kv.presses.latent_memory", "compensate_fused", "readout_memory"),
    ("core_kv.models.attention", "ragged_sdpa", "ragged_attention"),
    ("core_kv.models.attention", "_attention_with_lse", "attention"),  # decode steps that hand CORE their lse
    (ATTENTION, "sdpa", "attention"),
)


def resolve(owner: str, press):
    """The object a target's ``owner`` names (a module, a class, the press's indexer, the attention registry)."""
    if owner == INDEXER:
        return press.core.indexer
    if owner == ATTENTION:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS
    try:
        return importlib.import_module(owner)
    except ModuleNotFoundError:
        module, _, cls = owner.rpartition(".")
        return getattr(importlib.import_module(module), cls)


class Profiler:
    """Self CPU time per (phase, component) of wrapped callables."""

    def __init__(self):
        self.phase = "prefill"
        self.totals = defaultdict(float)  # (phase, component) -> seconds
        self.calls = defaultdict(int)
        self._stack: list[list[float]] = []  # [start, child time]
        self._undo = []

    def _timed(self, fn, component: str):
        prof = self

        @wraps(fn)
        def timed(*args, **kwargs):
            frame = [time.process_time(), 0.0]
            prof._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.process_time() - frame[0]
                prof._stack.pop()
                if prof._stack:
                    prof._stack[-1][1] += spent
                prof.totals[prof.phase, component] += spent - frame[1]
                prof.calls[prof.phase, component] += 1

        return timed

    def wrap(self, owner, attr: str, component: str, name: str) -> None:
        """Time ``owner.attr`` as ``component``; raises naming ``name`` when it does not exist."""
        if owner.__class__.__name__ == "AttentionInterface":  # transformers' registry of attention functions
            if attr not in owner.valid_keys():
                raise SystemExit(f"core_profile: attention implementation {name} is not registered")
            fn = owner._global_mapping[attr]
            owner._global_mapping[attr] = self._timed(fn, component)
            self._undo.append(lambda: owner._global_mapping.__setitem__(attr, fn))
            return
        try:
            static = inspect.getattr_static(owner, attr)
        except AttributeError:
            raise SystemExit(
                f"core_profile: target {name} does not exist (renamed or refactored?); update TARGETS in "
                f"{Path(__file__).name}"
            ) from None
        fn = getattr(owner, attr)
        is_static = isinstance(static, staticmethod)
        inherited = isinstance(owner, type) and attr not in vars(owner)
        setattr(owner, attr, staticmethod(self._timed(fn, component)) if is_static else self._timed(fn, component))
        if inherited:  # wrapped on the subclass: removing it uncovers the base class's again
            self._undo.append(lambda: delattr(owner, attr))
        else:
            self._undo.append(lambda: setattr(owner, attr, staticmethod(fn) if is_static else fn))

    def instrument(self, press) -> None:
        for owner, attr, component in TARGETS:
            self.wrap(resolve(owner, press), attr, component, f"{owner}.{attr}")

    def unwrap(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def by_component(self, phase: str) -> dict:
        return {c: t for (ph, c), t in self.totals.items() if ph == phase}


def run(model, press, ctx, steps: int, chunk: int | None, prof: Profiler | None) -> dict:
    from core_kv.pipeline import greedy_answer, prefill

    n = ctx.shape[1]
    if prof:
        prof.phase = "prefill"
    t0 = time.process_time()
    cache = prefill(model, ctx, press, chunk)
    t_pre = time.process_time() - t0
    if prof:
        prof.phase = "decode"
    t0 = time.process_time()
    greedy_answer(model, cache, n, torch.tensor([[7]]), steps, press, eos_token_ids=[])
    return {"prefill": t_pre, "decode": (time.process_time() - t0) / steps}


def components() -> list[str]:
    return list(dict.fromkeys(c for _, _, c in TARGETS))


def report(results: dict) -> str:
    """One table per phase: rows = components, columns = (length, configuration)."""
    cols = [(n, cfg) for n, per in results.items() for cfg in per]
    lines = []
    for phase, unit, scale in (("prefill", "ms", 1e3), ("decode", "ms/token", 1e3)):
        head = " | ".join(f"{n} {cfg}" for n, cfg in cols)
        lines += [f"\n{phase} ({unit}, self time)", f"| component | {head} |", "|---" * (len(cols) + 1) + "|"]
        for name, key in (("no compression", "none"), ("CORE", "core")):
            lines.append(
                f"| {name} | " + " | ".join(f"{scale * results[n][c][key][phase]:.1f}" for n, c in cols) + " |"
            )
        lines.append(
            "| CORE ÷ none | " + " | ".join(
                f"{results[n][c]['core'][phase] / results[n][c]['none'][phase]:.3f}" for n, c in cols) + " |"
        )  # fmt: skip
        for comp in components():
            cells = []
            for n, c in cols:
                r = results[n][c]
                t, calls = r["components"][phase].get(comp), r["calls"][phase].get(comp, 0)
                cells.append("not called" if not calls else f"{scale * t:.1f} ({100 * t / r['core'][phase]:.0f}%)")
            lines.append(f"| {comp} | " + " | ".join(cells) + " |")
        lines.append(
            "| rest of the model | " + " | ".join(
                f"{scale * (results[n][c]['core'][phase] - sum(results[n][c]['components'][phase].values())):.1f}"
                for n, c in cols) + " |"
        )  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--ratio", type=float, default=0.75)
    ap.add_argument("--chunk", type=int, default=None, help="chunked prefill (default: one-shot)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    add_model_args(ap, feature_spec=2)
    ap.add_argument(
        "--press-option",
        action="append",
        default=[],
        metavar="NAME.OPTION=VALUE",
        help="also profile CORE with these options (JSON values), as column NAME",
    )
    ap.add_argument("--out", default=None, help="write the raw totals (JSON) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = {"default": {}} | parse_press_options(args.press_option)

    from core_kv.presses import build_press

    model = bench_model(args.model, args.shape, args.layers)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint and args.model is None:  # the artifact's spec and policy on config-built layers
            ckpt = shape_artifact(model, Path(args.checkpoint), Path(tmp) / "core")
        elif args.checkpoint:
            ckpt = Path(args.checkpoint)
        else:
            ckpt = build_artifact(model, Path(tmp) / "core", args.feature_spec)

        def press(opts):
            return build_press("core", checkpoint=str(ckpt), compression_ratio=args.ratio, **opts)

        check = Profiler()
        check.instrument(press({}))  # every target exists (raises naming the first that does not)
        check.unwrap()
        ctx = torch.randint(3, model.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
        run(model, press({}), ctx, 2, args.chunk and min(args.chunk, 128), None)  # prime
        for n in args.lengths:
            ctx = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            results[n] = {}
            for name, opts in variants.items():
                base = run(model, None, ctx, args.steps, args.chunk, None)
                p = press(opts)
                prof = Profiler()
                prof.instrument(p)
                try:
                    core = run(model, p, ctx, args.steps, args.chunk, prof)
                finally:
                    prof.unwrap()
                per_step = {"decode": args.steps, "prefill": 1}
                results[n][name] = {
                    "none": base, "core": core, "options": opts,
                    "components": {ph: {c: t / per_step[ph] for c, t in prof.by_component(ph).items()}
                                   for ph in per_step},
                    "calls": {ph: {c: k for (p2, c), k in prof.calls.items() if p2 == ph} for ph in per_step},
                }  # fmt: skip
                print(f"[core_profile] {n} {name}: prefill ×{core['prefill'] / base['prefill']:.3f}, "
                      f"decode ×{core['decode'] / base['decode']:.3f}", flush=True)  # fmt: skip
    print(f"\n[core_profile] {args.model or args.shape}{f' ({args.layers} layers)' if args.layers else ''}, ratio "
          f"{args.ratio}, {'chunk ' + str(args.chunk) if args.chunk else 'one-shot'}, {args.steps} decode steps, "
          f"{args.threads} thread(s); configurations: {json.dumps(variants)}")  # fmt: skip
    print(report(results))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
