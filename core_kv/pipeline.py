"""Context/question protocol of kvpress's pipeline (``../shared/research/kvpress.md`` §1.5, benchmarks.md §1.9).

The context is prefilled under the press (compressed once); each ``question + question_suffix + answer_prefix``
is fed on top of the compressed cache with positions continuing from the *original* context length, then decoded
greedily up to ``max_new_tokens`` or EOS (never on the first token: :func:`greedy_answer`); the question and answer are trimmed from the cache afterwards, so all
questions of a context share one compression. Without a chat template the context gets a leading BOS and the
question suffix is ``"\\n"``; with one, the user turn is split at a separator exactly as kvpress does.

Beyond kvpress: chunked prefill (each chunk attends to the compressed past), and presses with ``decoding=True``
are re-prefilled per question (decode-time eviction changes the shared context, so it cannot be trimmed back).
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from core_kv.config import check_value, shown
from core_kv.models.attention import new_cache
from core_kv.models.cache import cache_kwarg, cache_marks, crop_cache, kv_bytes
from core_kv.models.loading import check_context_window
from core_kv.presses.base import BasePress


@dataclass
class Encoded:
    """Token ids of one context and its questions (each already joined with suffix and answer prefix)."""

    context_ids: torch.Tensor  # (1, N)
    question_ids: list[torch.Tensor]  # each (1, T_q)


def encode(
    tokenizer,
    context: str,
    questions: list[str],
    answer_prefixes: list[str] | None = None,
    use_chat_template: bool | None = None,
    max_context_length: int | None = None,
) -> Encoded:
    """Tokenize as kvpress's pipeline does; ``max_context_length`` keeps the head of the context."""
    answer_prefixes = answer_prefixes or [""] * len(questions)
    if len(answer_prefixes) != len(questions):
        raise ValueError("one answer prefix per question")
    if use_chat_template is None:
        use_chat_template = getattr(tokenizer, "chat_template", None) is not None
    if use_chat_template:
        sep = "#" * (len(context) + 10)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + sep}], add_generation_prompt=True, tokenize=False
        )
        context_text, suffix = text.split(sep)
        context_ids = tokenizer.encode(context_text, add_special_tokens=False)
    else:
        suffix = "\n"
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        context_ids = bos + tokenizer.encode(context, add_special_tokens=False)
    if not context_ids:
        raise ValueError("empty context")
    if max_context_length is not None:
        context_ids = context_ids[:max_context_length]
    qs = [
        torch.tensor([tokenizer.encode(q + suffix + a, add_special_tokens=False)])
        for q, a in zip(questions, answer_prefixes, strict=True)
    ]
    return Encoded(torch.tensor([context_ids]), qs)


def _body(model: nn.Module) -> nn.Module:
    return getattr(model, "model", model)


@torch.inference_mode()
def prefill(
    model: nn.Module,
    context_ids: torch.Tensor,
    press: BasePress | None = None,
    chunk_size: int | None = None,
    cache: DynamicCache | None = None,
) -> DynamicCache:
    """Run the context through the model body (no LM head) under ``press``; return the (compressed) cache.

    With ``chunk_size`` the context is fed in chunks and the press compresses after each chunk, so later
    chunks attend to the compressed past.
    """
    if context_ids.ndim != 2 or context_ids.shape[1] == 0:
        raise ValueError(f"context_ids must be (B, N) with N > 0, got {tuple(context_ids.shape)}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    cache = cache if cache is not None else new_cache(model)  # window layers keep <= W - 1 positions
    device = next(model.parameters()).device
    context_ids = context_ids.to(device)
    n = context_ids.shape[1]
    with press(model) if press is not None else nullcontext():
        if chunk_size is None or chunk_size >= n:
            _body(model)(input_ids=context_ids, use_cache=True, **{cache_kwarg(_body(model)): cache})
        else:
            with press.chunked_prefill(n) if press is not None else nullcontext():
                for start in range(0, n, chunk_size):
                    chunk = context_ids[:, start : start + chunk_size]
                    pos = torch.arange(start, start + chunk.shape[1], device=device)[None]
                    _body(model)(
                        input_ids=chunk, position_ids=pos, use_cache=True, **{cache_kwarg(_body(model)): cache}
                    )
    return cache


@torch.inference_mode()
def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` when they hold no NaN or +Inf (``-inf`` masks are fine), else ``FloatingPointError``: an answer
    decoded from them (``argmax`` of NaN is token 0) would be stored as a real result."""
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise FloatingPointError(
            "the model produced non-finite logits (NaN/Inf): its weights (or the cache a press left) are corrupt; "
            "nothing is stored for this cell — check the model's weights and rerun"
        )
    return logits


@torch.no_grad()
def greedy_answer(
    model: nn.Module,
    cache: DynamicCache,
    context_length: int,
    question_ids: torch.Tensor,
    max_new_tokens: int,
    press: BasePress | None = None,
    eos_token_ids: list[int] | None = None,
    trim: bool = True,
    stop_token_ids: list[int] | None = None,
    min_new_tokens: int = 1,
) -> list[int]:
    """Feed ``question_ids`` on top of ``cache`` at positions ``context_length...`` and decode greedily.

    Decoding ends at an eos token, or at a ``stop_token_ids`` token once at least one token was generated (neither
    is returned). The first ``min_new_tokens`` tokens are never eos: eos is excluded from their argmax
    (transformers' ``min_new_tokens``). The default 1 is the harness's eos protocol (``docs/evaluation.md``): an
    instruct model that closes its turn at once (SmolLM2 after NIAH's ``Answer:``) answers with its best non-eos
    token instead of the empty answer; kvpress never checks the first token and decodes past the eos instead.

    The press stays installed (ragged attention, decode-time eviction, memory readout) but does not compress
    the question unless it has ``decoding=True``. With ``trim`` the cache is restored to its pre-question size.
    Gradients are off: with them on (as before issue 61), every decode forward recorded an autograd graph that the
    cache's appended keys and values kept alive, pass after pass (~0.5 GB per 8-step pass on SmolLM2 at 1k, no press).
    """
    device = next(model.parameters()).device
    eos = set(eos_token_ids if eos_token_ids is not None else _eos_ids(model))
    stop = set(stop_token_ids or ())
    before = cache_marks(cache)
    q = question_ids.to(device)
    pos = context_length
    generated: list[int] = []
    key = cache_kwarg(model)
    with press(model) if press is not None else nullcontext():
        ids = q
        for _ in range(max_new_tokens):
            position_ids = torch.arange(pos, pos + ids.shape[1], device=device)[None]
            out = model(input_ids=ids, position_ids=position_ids, use_cache=True, logits_to_keep=1, **{key: cache})
            pos += ids.shape[1]
            logits = finite_logits(out.logits[0, -1])
            banned = [t for t in sorted(eos) if t < logits.shape[-1]] if len(generated) < min_new_tokens else []
            if banned:  # the answer may not end before min_new_tokens (an eos id outside the vocabulary never wins)
                logits = logits.clone()
                logits[banned] = float("-inf")
            token = int(logits.argmax())
            if token in eos or (generated and token in stop):
                break
            generated.append(token)
            ids = torch.tensor([[token]], device=device)
    if trim:
        crop_cache(cache, before)
    return generated


def _eos_ids(model: nn.Module) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


# tokenizer -> (vocabulary size, ids); weak keys: an entry dies with its tokenizer, so a new tokenizer that reuses
# a freed object's id never sees a stale entry
_NEWLINE_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def newline_token_ids(tokenizer) -> list[int]:
    """Ids of every vocabulary token whose decoded text contains a newline (cached per tokenizer and vocab size)."""
    cached = _NEWLINE_IDS.get(tokenizer)
    if cached is None or cached[0] != len(tokenizer):
        ids = range(len(tokenizer))
        texts = tokenizer.batch_decode([[i] for i in ids])
        cached = _NEWLINE_IDS[tokenizer] = (len(tokenizer), [i for i, t in zip(ids, texts, strict=True) if "\n" in t])
    return cached[1]


def check_generation_args(
    context,
    questions,
    press=None,
    answer_prefixes=None,
    max_new_tokens=32,
    chunk_size=None,
    use_chat_template=None,
    max_context_length=None,
    stop_at_newline=False,
) -> list[int]:
    """The one check of :func:`answer_questions`' arguments (the rule of :func:`core_kv.config.check_value`); returns
    each question's generation budget. Raises ``ValueError`` naming the argument, what is wrong and what would do."""
    check_value(context, str, "context")
    if not context.strip():
        raise ValueError("context is empty: there is nothing to compress (pass the long text the questions are about)")
    check_value(questions, list[str], "questions")
    if not questions:
        raise ValueError("questions is empty: pass at least one question")
    if answer_prefixes is not None:
        check_value(answer_prefixes, list[str], "answer_prefixes")
        if len(answer_prefixes) != len(questions):
            raise ValueError(f"answer_prefixes has {len(answer_prefixes)} entries for {len(questions)} questions")
    if isinstance(max_new_tokens, (list, tuple)):
        check_value(list(max_new_tokens), list[int], "max_new_tokens", ge=1)
        if len(max_new_tokens) != len(questions):
            raise ValueError(
                f"max_new_tokens has {len(max_new_tokens)} budgets for {len(questions)} questions: give one per "
                "question, or one integer for all"
            )
        budgets = list(max_new_tokens)
    else:
        check_value(max_new_tokens, int, "max_new_tokens", ge=1)
        budgets = [max_new_tokens] * len(questions)
    check_value(chunk_size, int | None, "chunk_size", ge=1)
    check_value(max_context_length, int | None, "max_context_length", ge=1)
    check_value(use_chat_template, bool | None, "use_chat_template")
    check_value(stop_at_newline, bool, "stop_at_newline")
    if isinstance(press, str):
        raise ValueError(
            f"press must be a press object, got the name {press!r}: build it with "
            f"build_press({press!r}, compression_ratio=...) (core_kv.presses)"
        )
    if press is not None and not isinstance(press, BasePress):
        raise ValueError(f"press must be a press built with core_kv.presses.build_press, or None; got {shown(press)}")
    return [int(b) for b in budgets]


def check_window(model: nn.Module, context_tokens: int, question_tokens: int, budget: int, what: str = "") -> None:
    """Raise :class:`~core_kv.models.loading.ContextWindowError` when the context, the question and the generation
    budget do not fit the model's context window (the check of :func:`answer_questions` and of ``eval.py``)."""
    total = context_tokens + question_tokens + budget
    detail = f"{context_tokens} context + {question_tokens} question tokens + {budget} new tokens"
    check_context_window(model, total, f"{what}: {detail}" if what else detail)


def answer_questions(
    model: nn.Module,
    tokenizer,
    context: str,
    questions: list[str],
    press: BasePress | None = None,
    answer_prefixes: list[str] | None = None,
    max_new_tokens: int | list[int] = 32,
    chunk_size: int | None = None,
    use_chat_template: bool | None = None,
    max_context_length: int | None = None,
    stop_at_newline: bool = False,
    min_new_tokens: int = 1,
) -> dict:
    """Compress ``context`` once and answer every question on that cache.

    ``stop_at_newline`` ends each answer before the first token after the first one whose text contains a newline;
    ``min_new_tokens`` tokens are generated before eos may end an answer (:func:`greedy_answer`).
    Returns ``{"answers": [str], "context_length": N, "kv_bytes": {...}, "aux_bytes": int}``: the KV payload and
    ``press.aux_bytes()`` (the state the press holds beside it while decoding) right after the first prefill.

    Raises:
        ValueError: a bad argument (:func:`check_generation_args`: an empty or non-string ``context``, no
            ``questions`` or a non-string one, a ``max_new_tokens`` that is not a positive integer or one per
            question, a press given by name, ...).
        ContextWindowError: the context, a question and its budget do not fit the model's context window.
    """
    budgets = check_generation_args(
        context, questions, press, answer_prefixes, max_new_tokens, chunk_size, use_chat_template,
        max_context_length, stop_at_newline,
    )  # fmt: skip
    enc = encode(tokenizer, context, questions, answer_prefixes, use_chat_template, max_context_length)
    stop = newline_token_ids(tokenizer) if stop_at_newline else None
    n = enc.context_ids.shape[1]
    for i, (q_ids, budget) in enumerate(zip(enc.question_ids, budgets, strict=True)):
        check_window(model, n, q_ids.shape[1], budget, f"question {i}")
    answers, cache = [], None
    for i, (q_ids, budget) in enumerate(zip(enc.question_ids, budgets, strict=True)):
        if cache is None or (press is not None and press.decoding):
            cache = prefill(model, enc.context_ids, press, chunk_size)
            if i == 0:
                payload = kv_bytes(cache)
                aux = press.aux_bytes() if press is not None else 0
        tokens = greedy_answer(
            model, cache, n, q_ids, budget, press, stop_token_ids=stop, min_new_tokens=min_new_tokens
        )
        answers.append(tokenizer.decode(tokens, skip_special_tokens=True))
    return {"answers": answers, "context_length": n, "kv_bytes": payload, "aux_bytes": aux}
