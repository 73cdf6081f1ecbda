"""The teacher's model and documents: loading the frozen model (through :mod:`core_kv.models.loading`), deterministic
documents by global index, and the event times inside a document."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from core_kv.features import (
    OBS_WINDOW,
)
from core_kv.models.loading import load_model as load_pretrained
from core_kv.models.tiny import tiny_lm
from core_kv.teacher.config import DataSpec, ModelSpec


@dataclass
class Doc:
    index: int
    ids: list[int]
    qa_start: int | None  # first token of the question/answer tail, None for plain text
    kind: str
    answer_start: int | None = None  # first answer token (the prompt ends before it), None for plain text


def load_model(spec_: ModelSpec, device) -> tuple[nn.Module, object | None]:
    """The frozen model and its tokenizer: a pretrained one through :func:`core_kv.models.loading.load_model` (packaged
    names resolved), or (``random_init``) a config-sized Llama seeded by ``spec_.seed``; ``tokenizer="build"`` builds
    the proxy tokenizer, another path loads that tokenizer instead of the model's own."""
    from transformers import AutoTokenizer

    from core_kv.models.packaged import resolve_model_path

    dtype = getattr(torch, spec_.dtype)
    if not spec_.random_init:
        spec_ = replace(spec_, path=resolve_model_path(spec_.path), tokenizer=resolve_model_path(spec_.tokenizer))
    local = spec_.path.startswith(("checkpoints/", "runs/", "./", "/"))
    if not spec_.random_init and local and not Path(spec_.path).is_dir():
        raise FileNotFoundError(
            f"model.path {spec_.path} does not exist: train/export the proxy LM first (python -m "
            "core_kv.proxy.train ...), or pass model.path=<HF folder or hub id>"
        )
    tok = None
    tok_path = spec_.tokenizer  # "" = the model's own (loaded with it below; none for a random init)
    if tok_path == "build":
        from core_kv.proxy.tokenizer import build_proxy_tokenizer

        tok = build_proxy_tokenizer()
    elif tok_path:
        tok = AutoTokenizer.from_pretrained(tok_path, revision=spec_.revision or None)
    if spec_.random_init:
        vocab = max(spec_.vocab_size, 64 * math.ceil(len(tok) / 64) if tok is not None else 0)
        model = tiny_lm(
            seed=spec_.seed,
            attn_implementation=spec_.attn_implementation,
            vocab_size=vocab,
            hidden_size=spec_.hidden_size,
            num_hidden_layers=spec_.num_layers,
            num_attention_heads=spec_.num_heads,
            num_key_value_heads=spec_.num_kv_heads,
            intermediate_size=spec_.intermediate_size,
            max_position_embeddings=8192,
        ).to(dtype)
    else:  # the adapter's loader: hub ids, local folders, packaged names, its error messages
        model, own_tokenizer = load_pretrained(
            spec_.path, dtype=dtype, attn_implementation=spec_.attn_implementation, revision=spec_.revision or None
        )
        tok = tok if tok_path else own_tokenizer
    return model.to(device).eval(), tok


def make_docs(data: DataSpec, indices: list[int], tokenizer) -> list[Doc]:
    """Deterministic documents by global index: the same index gives the same document in any process split."""
    if data.source == "random":
        out = []
        for i in indices:
            g = torch.Generator().manual_seed(data.seed * 1000 + i)
            n = int(torch.randint(data.min_len, data.max_len + 1, (1,), generator=g))
            ids = torch.randint(3, 500, (n,), generator=g).tolist()
            qa = n - 24 if i % 2 else None
            out.append(Doc(i, ids, qa, "random_qa" if qa else "random", n - 8 if qa else None))
        return out
    if data.source == "hf":
        import datasets

        ds = datasets.load_dataset(data.hf_dataset, split=data.hf_split)
        out = []
        for i in indices:
            row = ds[i % len(ds)]
            ctx = tokenizer(row[data.hf_context_field], add_special_tokens=True)["input_ids"]
            ans = tokenizer(row[data.hf_answer_field], add_special_tokens=False)["input_ids"]
            ans = ans[:512]
            room = max(data.max_len - len(ans), 2 * data.question_tokens)
            if len(ctx) > room:  # middle truncation (as LongBench does): keep the head and the question at the end
                ctx = ctx[: room // 2] + ctx[len(ctx) - (room - room // 2) :]
            qa = max(len(ctx) - data.question_tokens, 1)
            out.append(Doc(i, ctx + ans, qa, "hf", len(ctx)))
        return out
    from core_kv.proxy.data import Generator

    gen = Generator(tokenizer, seed=data.seed)
    names, weights = zip(*sorted(data.mix.items()), strict=True)
    out = []
    for i in indices:
        rng = random.Random(data.seed * 1000 + i)
        task, length = rng.choices(names, weights)[0], rng.randint(data.min_len, data.max_len)
        gen.rng = random.Random(data.seed * 1000 + i + 1)
        seq = gen.sample(task, length)
        first = next((j for j, a in enumerate(seq.ans) if a > 0), None)
        qa = None if first is None else max(first - data.question_tokens, 1)
        out.append(Doc(i, seq.ids, qa, task, first))
    return out


def event_times(n: int, qa_start: int | None, chunk: int) -> list[int]:
    """Event times t_e (number of cached tokens): chunk boundaries inside the context, plus the context end."""
    end = n if qa_start is None else qa_start
    times = list(range(chunk, end, chunk))
    if qa_start is not None and end > OBS_WINDOW and (not times or times[-1] != end):
        times.append(end)
    return times
