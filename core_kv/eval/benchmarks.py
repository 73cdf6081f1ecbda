"""Benchmark registry: each benchmark declares how its rows are loaded, how one context group is evaluated, and how
per-sample rows aggregate into a cell's metrics. The runner never branches on the benchmark's type.

A context group is the samples that share one ``context``: the runner compresses it once and answers every question
on that cache (kvpress's run flow, ``../shared/research/kvpress.md`` §3.2). The default evaluation is the QA path
(:func:`core_kv.pipeline.answer_questions` + :mod:`core_kv.eval.scorers`); the fidelity benchmark overrides it with
KL/top-1 measurements against the uncompressed model; NIAH adds a heat map.

Registration is by class statement, like presses::

    class MyBench(Benchmark, name="mybench"):
        def load(self, cfg, tokenizer, seed): ...
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from torch import nn

from core_kv.config import ConfigError, check_on_init, check_value, option
from core_kv.eval.schema import Sample
from core_kv.presses.base import BasePress

BENCHMARKS: dict[str, type[Benchmark]] = {}


class EmptyDatasetError(ValueError):
    """A benchmark produced no samples for the requested tasks/lengths."""


@dataclass
class BenchmarkConfig:
    """What to load for one benchmark entry of an evaluation.

    Args:
        kind: registered benchmark name; ``None`` means the entry's key (``datasets.ruler`` -> ``ruler``), so the same
            benchmark can appear twice under different keys (``datasets.ruler8k = {kind: ruler, lengths: [8192]}``).
        tasks: task names; ``None`` means the benchmark's default task set.
        lengths: target context lengths in tokens of the evaluated tokenizer (RULER, NIAH, fidelity). Datasets with
            natural lengths (LongBench, LooGLE) ignore it.
        num_samples: samples per (task, length); ``None`` means all (or the benchmark's default).
        source: local data instead of the hub (a folder or file, per benchmark); required by ``jsonl``.
        options: benchmark-specific settings (e.g. ``depths`` for NIAH).
    """

    kind: str | None = None
    tasks: list[str] | None = None
    lengths: list[int] = option(factory=list, ge=1)
    num_samples: int | None = option(None, ge=1)
    source: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def check(self, prefix: str = "") -> None:
        """Cross-field rules (the field checks are :func:`core_kv.config.check_config`'s): no duplicate task."""
        if self.tasks is not None and len(set(self.tasks)) != len(self.tasks):
            raise ConfigError(f"{prefix}tasks has duplicates: {list(self.tasks)}")


@dataclass
class GenerationConfig:
    """How contexts and questions are fed and answered (the same for every method of a run).

    Args:
        max_new_tokens: cap on each sample's own generation budget (``None`` keeps the benchmark's; smoke runs cap it,
            which makes scores not comparable to published ones).
        chunk_size: chunked prefill (each chunk attends to the compressed past); ``None`` prefills at once.
        use_chat_template: ``None`` uses the tokenizer's chat template when it has one.
        max_context_length: keep only the first tokens of each context (kvpress's head truncation); ``None`` keeps all.
        stop_at_newline: also end an answer at a token whose text contains a newline, once the answer has begun
            (lm-eval's ``until: ["\\n"]``). Off by default (RULER decodes to the budget); for a small model that
            never emits eos it cuts decoding several-fold without changing a string-match score that the answer
            line decides.
        compress_questions: the question-aware protocol (kvpress's ``compress_questions``): each question is
            appended to its context and compressed with it, and only the question suffix and answer prefix are fed
            after the compression. Every sample becomes its own context (one prefill per question). Off by default:
            the question-agnostic protocol, the question fed on top of the compressed context.
        min_new_tokens: tokens generated before an eos token may end an answer; eos is excluded from their argmax
            (transformers' ``min_new_tokens``). 1, the harness's eos protocol (``docs/evaluation.md``): an answer is
            never empty because the model closed its turn at once. 0 stops on a first-token eos (the rule before
            this option existed; results folders without it in their ``config.yaml`` were computed so).
    """

    max_new_tokens: int | None = option(None, ge=1)
    chunk_size: int | None = option(None, ge=1)
    use_chat_template: bool | None = None
    max_context_length: int | None = option(None, ge=1)
    stop_at_newline: bool = False
    compress_questions: bool = False
    min_new_tokens: int = option(1, ge=0)

    def __post_init__(self):
        check_on_init(self)

    def fed(self, sample: Sample) -> Sample:
        """The sample as this protocol feeds it: with ``compress_questions`` the question moves into the context."""
        if not self.compress_questions or not sample.question:
            return sample
        return replace(sample, context=sample.context + sample.question, question="")

    def budget(self, sample: Sample) -> int:
        """Generation budget of one sample after the cap."""
        return sample.max_new_tokens if self.max_new_tokens is None else min(sample.max_new_tokens, self.max_new_tokens)


@dataclass
class GroupJob:
    """Everything one context group is evaluated with.

    Attributes:
        model: the evaluated model (eval mode, on its device).
        tokenizer: its tokenizer.
        press: the press of the cell (``full`` for the reference).
        samples: the group's samples (same ``context``), in dataset order.
        generation: feeding/answering options.
    """

    model: nn.Module
    tokenizer: Any
    press: BasePress
    samples: list[Sample]
    generation: GenerationConfig


class Benchmark:
    """Base of every benchmark: override :meth:`load`; the QA evaluation and mean-per-task aggregation are defaults.

    Class attributes:
        name: registry key.
        higher_is_better: direction of the headline number (``False`` for KL-style fidelity).
        unit: what the headline number is, for reports.
    """

    name: ClassVar[str] = ""
    higher_is_better: ClassVar[bool] = True
    unit: ClassVar[str] = "score (0-100)"

    def __init_subclass__(cls, name: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if name is not None:
            if name in BENCHMARKS:
                raise ValueError(f"benchmark name {name!r} registered twice")
            cls.name = name
            BENCHMARKS[name] = cls

    def load(self, cfg: BenchmarkConfig, tokenizer, seed: int) -> list[Sample]:
        """Rows of this benchmark in the project schema (abstract)."""
        raise NotImplementedError(f"{type(self).__name__} must implement load() (abstract)")

    def evaluate_group(self, job: GroupJob) -> list[dict]:
        """Compress the group's context once, answer every question, score each answer.

        Returns:
            One dict per sample, in order, with ``prediction``, ``score``, ``kv_bytes``, ``aux_bytes`` and
            ``context_tokens``.
        """
        from core_kv.eval.scorers import score_sample
        from core_kv.pipeline import answer_questions

        samples, gen = job.samples, job.generation
        out = answer_questions(
            job.model,
            job.tokenizer,
            samples[0].context,
            [s.question for s in samples],
            press=job.press,
            answer_prefixes=[s.answer_prefix for s in samples],
            max_new_tokens=[gen.budget(s) for s in samples],
            chunk_size=gen.chunk_size,
            use_chat_template=gen.use_chat_template,
            max_context_length=gen.max_context_length,
            stop_at_newline=gen.stop_at_newline,
            min_new_tokens=gen.min_new_tokens,
        )
        return [
            {
                "prediction": pred,
                "score": score_sample(s, pred),
                "kv_bytes": int(out["kv_bytes"]["total"]),
                "aux_bytes": int(out["aux_bytes"]),
                "context_tokens": int(out["context_length"]),
            }
            for s, pred in zip(samples, out["answers"], strict=True)
        ]

    def aggregate(self, rows: list[dict], samples: list[Sample]) -> dict:
        """Cell metrics from its rows: per-task scores with the reference arithmetic, their mean, per-length means.

        Args:
            rows: per-sample result rows (``task``, ``length``, ``prediction``, ...), in sample order.
            samples: the matching samples.

        Returns:
            ``{"tasks": {task: score}, "average": float, "average_label": str, "by_length": {L: mean}}``
            (``by_length`` only when the cell spans several lengths).
        """
        tasks = _task_scores(rows, samples)
        out = {"tasks": tasks, "average": _mean(tasks.values()), "average_label": f"mean of {len(tasks)} tasks"}
        lengths = sorted({r["length"] for r in rows})
        if len(lengths) > 1:
            out["by_length"] = {}
            for L in lengths:
                keep = [i for i, r in enumerate(rows) if r["length"] == L]
                at_l = _task_scores([rows[i] for i in keep], [samples[i] for i in keep])
                out["by_length"][str(L)] = _mean(at_l.values())
        return out

    def plots(self, cells: list[tuple[dict, list[dict]]], out_dir: Path, entry: str, label: str) -> list[Path]:
        """Benchmark-specific figures (none by default) of a run's cells, each ``(metrics, scored rows)``; ``entry``
        is the benchmark's name in the run, ``label`` the model's."""
        return []

    def report_tables(self, cells: list[dict]) -> list[tuple[str, str]]:
        """Extra methods × ratios tables for the report: ``(title, metrics key)`` pairs (none by default)."""
        return []


def _task_scores(rows: list[dict], samples: list[Sample]) -> dict[str, float]:
    """``scorers.task_score`` per task (RULER/LongBench means, LooGLE pooled cloze), tasks in order of appearance."""
    from core_kv.eval.scorers import task_score

    by_task: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_task.setdefault(r["task"], []).append(i)
    return {
        t: task_score([samples[i] for i in idx], [rows[i]["prediction"] for i in idx]) for t, idx in by_task.items()
    }


def _mean(values) -> float:
    values = list(values)
    return round(sum(values) / len(values), 2) if values else float("nan")


def get_benchmark(kind: str) -> Benchmark:
    """The registered benchmark called ``kind``; an unknown name raises ``ValueError`` listing the known ones."""
    if kind not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {kind!r}; registered: {', '.join(sorted(BENCHMARKS))}")
    return BENCHMARKS[kind]()


# ----------------------------------------------------------------------------------------------------------- RULER
class Ruler(Benchmark, name="ruler"):
    """RULER-11 regenerated offline and sized with the evaluated tokenizer (:mod:`core_kv.eval.ruler`)."""

    def load(self, cfg: BenchmarkConfig, tokenizer, seed: int) -> list[Sample]:
        from core_kv.eval.ruler import load_ruler

        if not cfg.lengths:
            raise ValueError("ruler needs datasets.<name>.lengths, e.g. [4096]")
        return load_ruler(
            cfg.tasks,
            list(cfg.lengths),
            500 if cfg.num_samples is None else cfg.num_samples,
            tokenizer,
            seed=seed,
            **dict(cfg.options),
        )

    def aggregate(self, rows: list[dict], samples: list[Sample]) -> dict:
        from core_kv.eval.ruler import RULER_11, ruler_average

        out = super().aggregate(rows, samples)
        if any(t in RULER_11 for t in out["tasks"]):
            out["average_label"], avg = ruler_average(out["tasks"])
            out["average"] = round(avg, 2)
        return out


# ------------------------------------------------------------------------------------------------------------ NIAH
class Niah(Benchmark, name="niah"):
    """Needle in a haystack over lengths × depths, with the heat map of :mod:`core_kv.eval.niah`."""

    def load(self, cfg: BenchmarkConfig, tokenizer, seed: int) -> list[Sample]:
        from core_kv.eval import niah

        if not cfg.lengths:
            raise ValueError("niah needs datasets.<name>.lengths, e.g. [1024, 2048]")
        return niah.load_niah(tokenizer, lengths=list(cfg.lengths), **dict(cfg.options))

    def aggregate(self, rows: list[dict], samples: list[Sample]) -> dict:
        out = super().aggregate(rows, samples)
        out["average_label"] = "NIAH string match (mean over lengths x depths)"
        return out

    def plots(self, cells: list[tuple[dict, list[dict]]], out_dir: Path, entry: str, label: str) -> list[Path]:
        """One depth x length heat map per cell, and with several cells the papers' figure: one row per removed
        ratio, one panel per method, the full cache first in each row (scores are 0-100: one colour scale)."""
        from core_kv.eval import niah
        from core_kv.eval.schema import ratio_label

        files = []
        for c, rows in cells:
            name = f"{entry}__{c['method']}__{ratio_label(c['ratio'])}"
            title = f"NIAH: {c['method']} @ {ratio_label(c['ratio'])} - {label}"
            files.append(niah.plot_niah_heatmap(rows, Path(out_dir) / f"niah_heatmap__{name}.png", title, vmax=100.0))
        if len(cells) > 1:
            by = {(c["method"], c["ratio"]): rows for c, rows in cells}
            full = [rows for c, rows in cells if c["ratio"] == 0]
            methods = list(dict.fromkeys(c["method"] for c, _ in cells if c["ratio"] > 0))
            ratios = sorted({c["ratio"] for c, _ in cells if c["ratio"] > 0})
            panels = [([("full cache", full[0])] if full else [])
                      + [(f"{m} @ {ratio_label(r)}", by.get((m, r))) for m in methods] for r in ratios]  # fmt: skip
            path = Path(out_dir) / f"niah_panels__{entry}.png"
            files.append(niah.plot_niah_panels(panels or [[("full cache", full[0])]], path, f"NIAH - {label}", 100.0))
        return files


# -------------------------------------------------------------------------------------------------------- Fidelity
class Fidelity(Benchmark, name="fidelity"):
    """Natural-text fidelity (:mod:`core_kv.eval.fidelity`): KL(full || compressed) of the next-token distribution
    over a teacher-forced continuation. Overrides the QA path; the full-cache log-probs of each document are
    computed once and reused by every method and ratio of the run (``options.keep_reference=false`` recomputes
    them per cell to save memory: ``4 * T * V`` bytes per document)."""

    higher_is_better: ClassVar[bool] = False
    unit: ClassVar[str] = "KL(full || compressed), nats/token (lower is better)"

    def __init__(self):
        self._reference: dict = {}
        self._keep = True

    def load(self, cfg: BenchmarkConfig, tokenizer, seed: int) -> list[Sample]:
        from core_kv.eval.fidelity import DEFAULT_LENGTHS, load_fidelity

        options = dict(cfg.options)
        self._keep = bool(options.pop("keep_reference", True))
        if cfg.source is not None:
            options["source"] = cfg.source
        return load_fidelity(
            lengths=list(cfg.lengths or DEFAULT_LENGTHS), tokenizer=tokenizer, max_docs=cfg.num_samples, **options
        )

    def evaluate_group(self, job: GroupJob) -> list[dict]:
        from core_kv.eval.fidelity import evaluate_fidelity_context

        reference = self._reference if self._keep else None
        rows = evaluate_fidelity_context(
            job.model, job.tokenizer, job.press, job.samples, reference, chunk_size=job.generation.chunk_size
        )
        for r in rows:
            r["score"] = r["kl"]
            r["context_tokens"] = r.pop("context_length")
            r["prediction"] = None
        return rows

    def report_tables(self, cells: list[dict]) -> list[tuple[str, str]]:
        return [
            ("perplexity ratio, compressed / full (lower is better, 1 = lossless)", "ppl_ratio"),
            ("top-1 agreement with the full cache (higher is better)", "top1_agreement"),
        ]

    def aggregate(self, rows: list[dict], samples: list[Sample]) -> dict:
        from core_kv.eval.fidelity import aggregate_fidelity

        agg = aggregate_fidelity(rows)
        return {
            "tasks": {f"fidelity_{L}": round(v["kl"], 4) for L, v in agg["lengths"].items()},
            "average": round(agg["avg"]["kl"], 4),
            "average_label": "KL nats/token (mean over lengths)",
            "ppl_ratio": round(agg["avg"]["ppl_ratio"], 4),
            "top1_agreement": round(agg["avg"]["top1_agreement"], 4),
            "fidelity": agg,
        }


# ------------------------------------------------------------------------------------------------------- LongBench
class LongBench(Benchmark, name="longbench"):
    """LongBench v1 (English); the official category average when all 16 tasks ran, else the task mean."""

    def load(self, cfg: BenchmarkConfig, tokenizer, seed: int) -> list[Sample]:
        from core_kv.eval.longbench import load_longbench

        return load_longbench(cfg.tasks, max_samples=cfg.num_samples, source=cfg.source, **dict(cfg.options))

    def aggregate(self, rows: list[dict], samples: list[Sample]) -> dict:
        from core_kv.eval.longbench import aggregate_longbench

        out = super().aggregate(rows, samples)
        official = aggregate_longbench(out["tasks"])
        out["categories"] = official["categories"]
        if official["avg"] is not None:
            out["average"], out["average_label"] = official["avg"], "LongBench Avg (6 categories)"
        else:
            out["average_label"] = f"LongBench partial: mean of {len(out['tasks'])}/16 tasks"
        return out


# ---------------------------------------------------------------------------------------------------------- LooGLE
class LooGLE(Benchmark, name="loogle"):
    """LooGLE; the headline per task is its first offline metric (ROUGE-L, cloze exact), pooled as LooGLE does."""

    def load(self, cfg: BenchmarkConfig, tokenizer, seed: int) -> list[Sample]:
        from core_kv.eval.loogle import load_loogle

        return load_loogle(cfg.tasks, max_samples=cfg.num_samples, source=cfg.source, **dict(cfg.options))

    def aggregate(self, rows: list[dict], samples: list[Sample]) -> dict:
        from core_kv.eval.loogle import aggregate_loogle

        out = super().aggregate(rows, samples)
        out["metrics_by_task"] = {
            task: aggregate_loogle(
                task,
                [s for s in samples if s.task == task],
                [r["prediction"] for r, s in zip(rows, samples, strict=True) if s.task == task],
            )["scores"]
            for task in out["tasks"]
        }
        return out


# ----------------------------------------------------------------------------------------------------------- JSONL
class JsonlSamples(Benchmark, name="jsonl"):
    """Rows already in the project schema (one ``Sample.to_dict()`` per line) from ``source``: a file or a folder of
    ``*.jsonl`` files. For custom data and for tests."""

    def load(self, cfg: BenchmarkConfig, tokenizer, seed: int) -> list[Sample]:
        from core_kv.files import read_jsonl

        if not cfg.source:
            raise ValueError("the jsonl benchmark needs datasets.<name>.source (a .jsonl file or a folder of them)")
        src = Path(cfg.source)
        files = sorted(src.glob("*.jsonl")) if src.is_dir() else [src]
        if not files or not files[0].is_file():
            raise FileNotFoundError(f"no JSONL samples at {src}")
        samples = [_jsonl_sample(f, k, row) for f in files for k, row in enumerate(read_jsonl(f), 1)]
        if cfg.tasks is not None:
            known = {s.task for s in samples}
            unknown = sorted(set(cfg.tasks) - known)
            if unknown:
                raise ValueError(f"unknown task(s) {unknown} in {src}; tasks there: {sorted(known)}")
            samples = [s for s in samples if s.task in set(cfg.tasks)]
        if cfg.num_samples is not None:
            kept, count = [], {}
            for s in samples:
                count[s.task] = count.get(s.task, 0) + 1
                if count[s.task] <= cfg.num_samples:
                    kept.append(s)
            samples = kept
        return samples


def _jsonl_sample(path: Path, k: int, row) -> Sample:
    """Record ``k`` of ``path`` as a question-answering sample; a malformed one raises naming the file and record."""
    from core_kv.eval.scorers import METRICS

    where = f"{path}: record {k}"
    if not isinstance(row, dict):
        raise ValueError(f"{where}: must be a JSON object of Sample fields, got {type(row).__name__}")
    try:
        if "max_new_tokens" in row:  # a question is answered: 1 token at least (Sample allows 0, for fidelity)
            check_value(row["max_new_tokens"], int, "max_new_tokens", ge=1)
        sample = Sample(**row)
    except TypeError as e:  # a missing or unknown field
        raise ValueError(f"{where}: {e}".replace("Sample.__init__() ", "")) from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if sample.metric not in METRICS:
        raise ValueError(f"{where}: metric must be one of {', '.join(sorted(METRICS))}, got {sample.metric!r}")
    return sample


def write_samples(path: str | Path, samples: list[Sample]) -> Path:
    """Write samples as JSONL for the ``jsonl`` benchmark."""
    from core_kv.files import atomic_write_text

    return atomic_write_text(path, "".join(json.dumps(s.to_dict(), ensure_ascii=False) + "\n" for s in samples))
