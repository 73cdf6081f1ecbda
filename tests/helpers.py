"""Helpers the test modules share (fixtures are in ``tests/conftest.py``); test modules import these, never each
other. Tiny models are built from config: no downloads.

- models and inputs: :func:`tiny_model`, :func:`ids`;
- CORE artifacts: :func:`fit_tiny_artifact`; the press contract's per-family models and artifacts (:func:`tiny`,
  :func:`core_artifact`, :func:`build_press`, :func:`can_compress`, :func:`model_for`);
- references: :func:`logits_after`, :func:`masked_full_cache_logits`, :func:`record_core_kept`;
- entry points: :func:`run` / :func:`tiny_args` (``train.py`` on a tiny random model), :func:`eval_samples` /
  :func:`eval_argv` (``eval.py`` on a toy JSONL benchmark).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch

from core_kv.core_model import CoreConfig, CoreModel
from core_kv.distill.replay import capture
from core_kv.eval.schema import Sample
from core_kv.models.cache import cache_kwarg
from core_kv.models.fingerprint import model_fingerprint
from core_kv.models.tiny import FAMILIES, TINY, tiny_lm
from core_kv.pipeline import prefill
from core_kv.presses import PRESSES, BasePress
from core_kv.presses import build_press as _build_press
from core_kv.presses.core import CorePress
from core_kv.teacher.geometry import fit_geometry

N = 200  # context tokens of :func:`ids`


def tiny_model(family: str = "llama", attn: str = "sdpa", seed: int = 0):
    """A 2-layer GQA model (4 query heads, 2 KV heads) of the given family, random weights, eval mode."""
    return tiny_lm(family, seed, attn)


def ids(n: int = N, seed: int = 1) -> torch.Tensor:
    """``(1, n)`` random token ids in [3, 128), seeded."""
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def fit_tiny_artifact(model, d_z: int = 16, num_prototypes: int = 16, seed: int | None = None, **config) -> CoreModel:
    """A CORE model for ``model`` (save it with ``save_pretrained``): a geometry fitted to one capture of
    ``ids(300, seed=9)``, an untrained indexer and memory (``config``: :meth:`CoreConfig.for_model` options), drawn
    after ``torch.manual_seed(seed)`` unless ``seed`` is None."""
    geo = fit_geometry([a.k_pre for a in capture(model, ids(300, seed=9))], model_fingerprint(model), d_z=d_z,
                       num_prototypes=num_prototypes)  # fmt: skip
    if seed is not None:
        torch.manual_seed(seed)
    core = CoreModel(CoreConfig.for_model(model, geo, **config))
    core.set_geometry(geo)
    return core


@contextmanager
def locked_by_another(folder: Path, what: str, command: str):
    """``folder`` locked (:mod:`core_kv.lock`) by another live process doing ``what``: yields its pid; the process is
    killed on exit, so the lock it leaves is stale."""
    from core_kv.lock import LOCK_NAME

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = {"pid": other.pid, "host": os.uname().nodename, "what": what, "command": command}
        (folder / LOCK_NAME).write_text(json.dumps(owner))
        yield other.pid
    finally:
        other.kill()
        other.wait()


def offline_hub_error(code: str, tmp_path: Path) -> str:
    """The last stderr line of ``code`` run in a fresh interpreter with the hub offline and an empty cache (it must
    fail): what a user without network sees from a loader that reads the hub."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout
    return proc.stderr.strip().splitlines()[-1]


def logits_after(model, press, ctx, question, chunk_size=None):
    """Logits of the question tokens fed on top of the (compressed) context."""
    cache = prefill(model, ctx, press, chunk_size)
    pos = torch.arange(ctx.shape[1], ctx.shape[1] + question.shape[1])[None]
    with torch.inference_mode(), press(model) if press is not None else nullcontext():
        out = model(input_ids=question, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits


def record_core_kept(press, layers) -> dict[int, list[torch.Tensor]]:
    """Wrap ``press``'s CORE scorer so that every eviction event of ``layers`` appends the kept positions
    ``(Hkv, k)`` the scorer holds after it; returns the (filling) record."""
    kept: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    scorer, evicted = press.scorer, press.scorer.evicted

    def recording(module, *args):
        evicted(module, *args)
        kept[module.layer_idx].append(scorer._layers[module.layer_idx].pos.clone())

    scorer.evicted = recording
    return kept


def masked_full_cache_logits(model, family_module, cache, keep, question, positions) -> torch.Tensor:
    """The reference for a compressed cache: ``question``'s logits over the full ``cache`` with each KV head's
    evicted keys masked out in eager attention. ``keep`` maps a layer index to its ``(Hkv, S)`` boolean mask of kept
    positions (the question's included); other layers run the model's own eager attention (sliding windows too)."""
    import torch.nn.functional as F

    from core_kv.models.cache import cache_kwarg

    eager = family_module.eager_attention_forward

    def masked_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if module.layer_idx not in keep:
            return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        groups = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        logits = query @ k.transpose(2, 3) * scaling  # (1, H, T, S)
        t, s = logits.shape[-2:]
        visible = keep[module.layer_idx][:, :s].repeat_interleave(groups, 0)[None, :, None]
        visible = visible & (torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None])[None, None]
        out = F.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1) @ v
        return out.transpose(1, 2).contiguous(), None

    implementation = model.config._attn_implementation
    try:
        family_module.eager_attention_forward = masked_eager
        model.config._attn_implementation = "eager"
        with torch.inference_mode():
            return model(input_ids=question, position_ids=positions, **{cache_kwarg(model): cache}).logits
    finally:
        family_module.eager_attention_forward = eager
        model.config._attn_implementation = implementation


# ------------------------------------------------------------------------------------------------------------------
# The press contract's models and artifacts (tests/test_presses_contract.py, tests/test_paper_protocol.py)

N_CTX = N
COMMON = dict(TINY, vocab_size=128, max_position_embeddings=2048)  # core_kv.models.tiny's shape, smaller vocabulary
ARCHS = tuple(FAMILIES)  # every family core_kv.models.tiny builds
_MODELS: dict = {}
CORE_ARTIFACTS: dict = {}  # "dir": the folder (the ``contract_artifacts`` fixture sets it per module); arch -> path
CORE_NAMES = {name for name, cls in PRESSES.items() if issubclass(cls, CorePress)}


def tiny(arch: str, eager: bool = False) -> torch.nn.Module:
    """A 2-layer GQA model (4 query / 2 KV heads) of ``arch``, seeded, cached per (arch, attention). Gemma 2 runs eager
    (transformers' SDPA path drops its logit softcap)."""
    eager = eager or arch == "gemma2"
    if (arch, eager) not in _MODELS:
        _MODELS[arch, eager] = tiny_lm(arch, 0, "eager" if eager else "sdpa", **COMMON)
    return _MODELS[arch, eager]


def core_artifact(arch: str) -> str:
    """A CORE artifact fitted to ``tiny(arch)`` (geometry from one capture, untrained indexer), cached per arch."""
    if arch not in CORE_ARTIFACTS:
        path = CORE_ARTIFACTS["dir"] / arch
        fit_tiny_artifact(tiny(arch), d_z=8, num_prototypes=8, protected_sinks=0, protected_recent=0).save_pretrained(
            path
        )
        CORE_ARTIFACTS[arch] = str(path)
    return CORE_ARTIFACTS[arch]


def build_press(name: str, arch: str = "llama", **options) -> BasePress:
    """``core_kv.presses.build_press``, with CORE's presses given the artifact fitted to ``tiny(arch)`` when they
    compress (their no-op form needs none)."""
    if name in CORE_NAMES and (options.get("budget") is not None or options.get("compression_ratio", 0.0) != 0.0):
        options = {"checkpoint": core_artifact(arch), **options}
    return _build_press(name, **options)


def can_compress(name: str) -> bool:
    try:
        build_press(name, compression_ratio=0.5)
    except ValueError:
        return False
    return True


def skip_unless_compressing(name: str) -> None:
    if not can_compress(name):
        pytest.skip(f"{name} never compresses (compression_ratio must stay 0)")


def model_for(press: BasePress, arch: str = "llama") -> torch.nn.Module:
    return tiny(arch, eager=bool(press.needs_attentions))


# ------------------------------------------------------------------------------------------------------------------
# Entry points


# train.py options for a random-init teacher LM of the test shape on random documents (every tiny train run)
TINY_TEACHER = (
    "teacher.model.random_init=true",
    "teacher.model.path=''",
    "teacher.model.hidden_size=64",
    "teacher.model.num_layers=2",
    "teacher.model.num_heads=4",
    "teacher.model.num_kv_heads=2",
    "teacher.model.intermediate_size=128",
    "teacher.data.source=random",
)


def tiny_args(out: Path, teacher: Path, *extra: str) -> list[str]:
    """``train.py`` options for a tiny random-init run (teacher into ``teacher``, the artifact into ``out``)."""
    return [
        f"out_dir={out}",
        f"teacher.out_dir={teacher}",
        "teacher.chunk_size=64",
        "teacher.protected_recent=8",  # leaves free picks at 75% on 64-token events, so Table 7 rows exist
        "teacher.progress=false",
        *TINY_TEACHER,
        "teacher.data.num_docs=3",
        "teacher.data.calib_docs=2",
        "teacher.data.min_len=160",
        "teacher.data.max_len=200",
        "train_docs=4",
        "calib_docs=2",
        "eval_docs=1",
        "eval_ratios=[0.75]",
        "indexer.warmup_steps=2",
        "indexer.records_per_micro=4",
        "indexer.steps=3",
        "memory.steps=2",
        "save_every=1",
        "progress=false",
        *extra,
    ]


def run(args: list[str]) -> dict:
    """``train.py``'s ``main`` on ``args``."""
    import train

    return train.main(args)


def eval_samples() -> list[Sample]:
    """3 contexts, 4 questions (one context shared by 2 questions), 2 tasks; ~150-250 tokens each."""
    filler = " ".join(f"Line {i}: the grass is green and the sky is blue." for i in range(18))
    out = []
    for k, (code, city) in enumerate([("4242", "Paris"), ("7781", "Oslo"), ("1357", "Lima")]):
        context = f"Record {k}. {filler} The secret code is {code}. The capital is {city}. {filler[: 200 * k]}"
        out.append(
            Sample("toy", "code", context, "What is the secret code?", "Answer:", [code], 8, "string_match_all", 256)
        )
        if k == 0:
            out.append(
                Sample("toy", "city", context, "What is the capital?", "Answer:", [city], 8, "string_match_part", 256)
            )
    return out


def eval_argv(data: Path, out: Path, *extra: str) -> list[str]:
    """``eval.py`` options: knorm and snapkv at 25% and 50% on the toy benchmark ``data``, into ``out``."""
    return [
        "model.name=tiny",
        "methods=[knorm,snapkv]",
        "ratios=[0.25,0.5]",
        "benchmarks=[toy]",
        "datasets.toy.kind=jsonl",
        f"datasets.toy.source={data}",
        f"output_dir={out}",
        "progress=false",
        "cpu_threads=1",
        *extra,
    ]


class PieceTokenizer:
    """Offline stand-in for an HF tokenizer: a word or punctuation mark with its leading whitespace is one token."""

    _PIECE = re.compile(r"\s*(?:\w+|[^\w\s])|\s+")

    def __init__(self):
        self.ids: dict[str, int] = {}
        self.pieces: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        for piece in self._PIECE.findall(text):
            if piece not in self.ids:
                self.ids[piece] = len(self.pieces)
                self.pieces.append(piece)
            out.append(self.ids[piece])
        return out

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)
