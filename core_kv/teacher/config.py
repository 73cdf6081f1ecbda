"""The teacher run's typed config: the frozen model (:class:`~core_kv.models.loading.ModelSpec`), the documents
(:class:`~core_kv.documents.DataSpec`), the events and the solver (YAML diffs in ``configs/teacher/``), and the event
times inside a document (:func:`event_times`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from core_kv.config import ConfigError, check_on_init, folder, non_empty, option, parse_layers
from core_kv.documents import DataSpec
from core_kv.features import FEATURE_SPECS, OBS_WINDOW, check_version
from core_kv.models.loading import ModelSpec
from core_kv.teacher.utility import POOLS

# ---------------------------------------------------------------------------------------------------------------
# Config


def _eta_ok(eta: str) -> str | None:
    if eta == "auto":
        return None
    try:
        e = float(eta)
    except ValueError:
        e = float("nan")
    return None if 0 < e <= 1 else "'auto' or a number in (0, 1]"


def _metrics_docs_ok(n: int) -> str | None:
    return None if n == -1 or n >= 1 else "-1 (all documents) or >= 1"


def _feature_spec_ok(version: int) -> str | None:
    try:
        check_version(version)
    except ValueError:
        return f"a feature spec this code computes ({', '.join(map(str, sorted(FEATURE_SPECS)))})"
    return None


@dataclass
class TeacherConfig:
    """Everything a teacher run depends on; YAML files in ``configs/teacher/`` override these defaults.

    Args:
        out_dir: the teacher dataset folder (safetensors shards, ``manifest.json``, geometry, ``metrics.json``,
            ``report.md``); train.py reuses it when its manifest matches the model and these options. A folder holding
            a finished dataset of this config is kept (the run says so and returns); one of another config is refused
            unless ``overwrite``.
        overwrite: replace a finished dataset of another config in ``out_dir`` (the only way a run replaces one).
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
        records_per_shard: at most this many records per safetensors shard (a shard also ends with each document,
            the run's resume point).
        feature_dtype: storage dtype of the 14 features (``float16`` halves the dataset; ``float32``).
        progress: show a progress bar.
    """

    out_dir: str = option("runs/teacher/default", check=folder)
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    chunk_size: int = option(512, gt=OBS_WINDOW)  # > the observation window
    qa_weight: float = option(0.5, ge=0, le=1)
    lam: float = option(2.0, ge=0)
    # per-layer coverage weights overriding ``lam``: {"18-21": 32.0} (a deviation from the paper's single λ;
    # docs/method.md "CORE on SmolLM2-135M")
    lam_layers: dict[str, float] = field(default_factory=dict)
    steps: int = option(8, ge=1)  # R0 [paper Table 5]
    ref_steps: int = option(16, ge=1)  # Table 5 reference
    eta: str = option("auto", check=_eta_ok)  # "auto" or a number in (0, 1]
    ratios: list[float] = option(factory=lambda: [0.75, 0.9], ge=0, lt=1, check=non_empty)
    protected_sinks: int = option(4, ge=0)
    protected_recent: int = option(32, ge=0)
    d_z: int = option(64, ge=1)
    num_prototypes: int = option(64, ge=1)
    geometry_path: str = ""  # "" = <out_dir>/geometry.safetensors (fitted if absent)
    metrics: bool = True
    # Table 5/7 on documents with index < this only (-1: all); the greedy is O(B·N·M)
    metrics_docs: int = option(-1, check=_metrics_docs_ok)
    records_per_shard: int = option(256, ge=1)
    feature_dtype: str = option("float16", choices=("float16", "float32"))
    threads: int = option(1, ge=0)  # >0: torch.set_num_threads (1 is fastest on shared CPUs; 0 = leave it)
    progress: bool = True
    # feature spec of the records (core_kv.features.FEATURE_SPECS): 1 = the shipped artifacts', 2 = key
    # distinctiveness (KeyDiff) and twin rarity (TwinKV) in place of the sink/local flags (docs/method.md)
    features: int = option(1, check=_feature_spec_ok)
    # how the future queries' attention becomes utility (core_kv.teacher.utility.future_utility): "mean" (CORE.md
    # stage 1) or "max" per query group (a deviation: docs/method.md, "Max-pooled utility")
    utility_pool: str = option("mean", choices=POOLS)
    overwrite: bool = False

    def __post_init__(self) -> None:
        check_on_init(self)

    def check(self, prefix: str = "") -> None:
        if self.ref_steps < self.steps:
            raise ConfigError(f"{prefix}ref_steps must be >= {prefix}steps ({self.steps}), got {self.ref_steps}")
        try:
            self.lam_at(0)  # validates lam_layers
        except ValueError as e:
            raise ConfigError(f"{prefix}{e}") from None

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


def event_times(n: int, qa_start: int | None, chunk: int) -> list[int]:
    """Event times t_e (number of cached tokens): chunk boundaries inside the context, plus the context end."""
    end = n if qa_start is None else qa_start
    times = list(range(chunk, end, chunk))
    if qa_start is not None and end > OBS_WINDOW and (not times or times[-1] != end):
        times.append(end)
    return times
