"""The CORE artifact, PreTrainedModel-style (CORE.md stages 2–4): :class:`CoreConfig` + :class:`CoreModel`.

:class:`CoreModel` (``checkpoints/<run>/final/``) is ``config.json`` + ``model.safetensors`` with the indexer
(:mod:`core_kv.indexer`), the temperatures, the latent memory and gate (:mod:`core_kv.memory`), the stage-0 geometry,
the feature statistics and the base-model fingerprint. Load it offline with ``CoreModel.from_pretrained(path)``; pass
``base_model=`` to refuse a different base model (layers, heads, head dim or weights digest) with a clear error.

Shapes: L layers, H query heads, Hkv KV heads, D head dim, F = 14 features, d_z projected key dim, M prototypes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from core_kv.fast_memory import DECAY, GATE_HIDDEN, KERNELS, READOUTS, FastMemory
from core_kv.features import FEATURE_SPECS, SHARED_SPECS, spec, spec_differences
from core_kv.features_v3 import compute_features_v3, special_mask
from core_kv.geometry import FingerprintMismatch, Geometry, check_fingerprint, model_fingerprint
from core_kv.indexer import CoreIndexer
from core_kv.key_geometry import KeyGeometry
from core_kv.memory import MEMORY_DIM, WRITE_RULES, LatentMemory
from core_kv.models.loading import looks_local
from core_kv.policy import PAPER, InferencePolicy, PolicyOptions

ARTIFACT_VERSION = 1
MEMORY_KINDS = ("latent", "fast")
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CoreConfig(PretrainedConfig):
    """Geometry of the base model and the CORE settings an artifact was trained with.

    Args:
        num_layers, num_heads, num_kv_heads, head_dim: Base-model attention geometry.
        d_z, num_prototypes: Stage-0 geometry sizes (paper: 64, 64).
        memory_dim: P (512, paper Table 9).
        write_rule: ``mass`` | ``equal_event`` | ``uniform_token`` (CORE.md stage 4).
        protected_sinks, protected_recent: Tokens always kept at an event (inside B).
        chunk_size: Prefill chunk the indexer was trained on.
        fingerprint: :func:`~core_kv.teacher.geometry.model_fingerprint` of the base model.
        feature_spec: :func:`core_kv.features.spec` at training time.
        teacher: The teacher's parameters (λ, R0, …) from its manifest.
        inference_policy: The composition to run per compression-ratio band, chosen by ``train.py``'s policy stage
            on its own validation prompts (:class:`~core_kv.policy.InferencePolicy` as a dict); ``None``: the paper's
            press.
        memory_kind: ``latent`` (:mod:`core_kv.memory`, one state per KV head, the reconstruction of CORE.md) or
            ``fast`` (:mod:`core_kv.fast_memory`, the authors' release: one state per layer, post-RoPE queries).
        memory_gate_hidden, memory_decay: The fast memory's gate width and decay γ across events.
        memory_readout: The fast memory's correction: ``residual`` (the release: ``o_R + g m``) or ``interpolate``
            (the paper's form: ``o_R + g (m − o_R)``), :class:`~core_kv.fast_memory.FastMemory`.
        memory_kernel: The fast memory's kernel: ``released`` (signed) or ``positive`` (:func:`core_kv.fast_memory.read`).
        memory_dtype: Storage dtype of the memory's weights in ``model.safetensors`` (``float32``, ``float16``,
            ``bfloat16``); they are computed in float32 after loading.
        special_token_ids: Token ids the spec-v3 ``sink`` feature flags (the tokenizer's special tokens).
        ablated_features: Feature names the indexer never sees (zeroed at its input; ``online.ablate_features``).
        memory_trained: False for an artifact whose memory was never trained (``online.memory=false``): its
            default policy runs no memory, and a press that asks for the memory is refused.
        trained_selection: The retained sets the indexer and the memory were trained under (``train.py``'s
            ``selection``): ``per_head`` (every artifact before the option) or ``shared`` (one set per layer shared by
            the KV heads, what ``head_shared`` serves).
    """

    model_type = "core_kv"

    def __init__(
        self,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 16,
        d_z: int = 16,
        num_prototypes: int = 64,
        memory_dim: int = MEMORY_DIM,
        write_rule: str = "mass",
        protected_sinks: int = 4,
        protected_recent: int = 32,
        chunk_size: int = 512,
        fingerprint: dict | None = None,
        feature_spec: dict | None = None,
        teacher: dict | None = None,
        inference_policy: dict | None = None,
        artifact_version: int = ARTIFACT_VERSION,
        memory_kind: str = "latent",
        memory_gate_hidden: int = GATE_HIDDEN,
        memory_decay: float = DECAY,
        memory_dtype: str = "float32",
        memory_readout: str = "residual",
        memory_kernel: str = "released",
        special_token_ids: list[int] | None = None,
        ablated_features: list[str] | None = None,
        memory_trained: bool = True,
        trained_selection: str = "per_head",
        **kwargs,
    ):
        if write_rule not in WRITE_RULES:
            raise ValueError(f"write_rule must be one of {WRITE_RULES}, got {write_rule!r}")
        if memory_kind not in MEMORY_KINDS:
            raise ValueError(f"memory_kind must be one of {MEMORY_KINDS}, got {memory_kind!r}")
        if memory_kernel not in KERNELS:
            raise ValueError(f"memory_kernel must be one of {KERNELS}, got {memory_kernel!r}")
        if memory_readout not in READOUTS:
            raise ValueError(f"memory_readout must be one of {READOUTS}, got {memory_readout!r}")
        if memory_dtype not in STORAGE_DTYPES:
            raise ValueError(f"memory_dtype must be one of {sorted(STORAGE_DTYPES)}, got {memory_dtype!r}")
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = (
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        self.d_z, self.num_prototypes, self.memory_dim, self.write_rule = d_z, num_prototypes, memory_dim, write_rule
        self.protected_sinks, self.protected_recent, self.chunk_size = protected_sinks, protected_recent, chunk_size
        self.fingerprint = fingerprint or {}
        self.feature_spec = feature_spec or spec()
        self.teacher = teacher or {}
        self.inference_policy = inference_policy
        self.artifact_version = artifact_version
        self.memory_kind, self.memory_gate_hidden, self.memory_decay = memory_kind, memory_gate_hidden, memory_decay
        self.memory_dtype, self.memory_readout, self.memory_kernel = memory_dtype, memory_readout, memory_kernel
        self.special_token_ids = list(special_token_ids or [])
        self.ablated_features = list(ablated_features or [])
        self.memory_trained = bool(memory_trained)
        if trained_selection not in ("per_head", "shared"):
            raise ValueError(f"trained_selection must be 'per_head' or 'shared', got {trained_selection!r}")
        self.trained_selection = trained_selection
        unknown = sorted(set(self.ablated_features) - set(self.feature_spec.get("names") or []))
        if unknown:
            raise ValueError(f"ablated_features {unknown} are not in the feature spec's names "
                             f"{list(self.feature_spec.get('names') or [])}")  # fmt: skip
        super().__init__(**kwargs)

    @property
    def shared_scores(self) -> bool:
        """One score per token per layer, broadcast to the KV heads (feature spec v3) instead of one per KV head."""
        return self.feature_spec.get("version") in SHARED_SPECS

    @classmethod
    def for_model(cls, model: nn.Module, geometry: Geometry, **kwargs) -> CoreConfig:
        """A config matching ``model`` (dims and fingerprint) and ``geometry`` (d_z, M)."""
        fp = model_fingerprint(model)
        return cls(
            num_layers=fp["layers"], num_heads=fp["heads"], num_kv_heads=fp["kv_heads"], head_dim=fp["head_dim"],
            d_z=geometry.proj.shape[-2], num_prototypes=geometry.num_prototypes, fingerprint=fp, **kwargs,
        )  # fmt: skip


class CorePreTrainedModel(PreTrainedModel):
    config_class = CoreConfig
    base_model_prefix = "core"
    main_input_name = "features"

    def _init_weights(self, module: nn.Module) -> None:  # weights are initialised by the modules themselves
        pass


class CoreModel(CorePreTrainedModel):
    """The CORE artifact: indexer + temperatures + latent memory/gate + geometry + feature statistics.

    Example::

        core = CoreModel.from_pretrained("checkpoints/core-proxy/final", base_model=model)
        s = core.indexer.scores(layer, features)                  # (Hkv, N)
        p = core.indexer.distribution(layer, s)                   # calibrated
        state = core.memory.write(state, layer, k_pre, v, write_weights(p, evicted, core.config.write_rule))
    """

    def __init__(self, config: CoreConfig):
        super().__init__(config)
        c = config
        self.indexer = CoreIndexer(c.num_layers, 1 if c.shared_scores else c.num_kv_heads)
        if c.ablated_features:
            self.indexer.ablate([c.feature_spec["names"].index(n) for n in c.ablated_features])
        if c.memory_kind == "fast":
            self.memory = FastMemory(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.memory_dim,
                                     c.memory_gate_hidden, c.memory_readout, c.memory_kernel)  # fmt: skip
        else:
            self.memory = LatentMemory(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.memory_dim)
        m = c.num_prototypes
        if c.shared_scores:  # the released fixed geometry (core_kv.key_geometry)
            self.register_buffer("key_projection", torch.zeros(c.num_layers, c.d_z, c.num_kv_heads * c.head_dim))
            self.register_buffer("key_prototypes", torch.zeros(m, c.d_z))
            self.register_buffer("key_rotation", torch.zeros(c.d_z, c.d_z))
        else:
            self.register_buffer("geo_mean", torch.zeros(c.num_layers, c.num_kv_heads, c.head_dim))
            self.register_buffer("geo_proj", torch.zeros(c.num_layers, c.num_kv_heads, c.d_z, c.head_dim))
            self.register_buffer("geo_prototypes", torch.zeros(c.num_layers, c.num_kv_heads, m, c.d_z))
            self.register_buffer("geo_gamma", torch.ones(c.num_layers, c.num_kv_heads))
            self.register_buffer("geo_kmm_inv_sqrt", torch.zeros(c.num_layers, c.num_kv_heads, m, m))
        self.post_init()

    @torch.no_grad()
    def set_key_geometry(self, geometry: KeyGeometry) -> None:
        """Store the released fixed key geometry (feature spec v3 artifacts)."""
        for name, src in (("projection", geometry.projection), ("prototypes", geometry.prototypes),
                          ("rotation", geometry.rotation)):  # fmt: skip
            dst = getattr(self, f"key_{name}")
            if src.shape != dst.shape:
                raise ValueError(f"key geometry {name} {tuple(src.shape)} vs artifact {tuple(dst.shape)}")
            dst.copy_(src)

    def key_geometry(self) -> KeyGeometry:
        """The released fixed key geometry stored in a spec-v3 artifact."""
        return KeyGeometry(self.key_projection.detach(), self.key_prototypes.detach(), self.key_rotation.detach())

    @torch.no_grad()
    def released_scores(
        self,
        layer: int,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        query_pos: torch.Tensor,
        key_pos: torch.Tensor,
        seq_len: int,
        scaling: float,
        phase: int = 0,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One score per candidate (N,) of a spec-v3 artifact at one event of ``layer``, shared by the KV heads.

        Args:
            queries: The event's post-RoPE queries (H, T, D) at ``query_pos`` (T,) (every prefill query; the last
                decode interval's queries at a decode event).
            keys, values: The cached post-RoPE keys and values (Hkv, N, D) at ``key_pos`` (N,).
            seq_len: Tokens processed so far (the uncompressed length).
            scaling: The attention module's score scale.
            phase: 0 at a prefill event, 1 at a decode event.
            token_ids: The candidates' token ids (N,), for the special-token flag (``None``: sinks only).
        """
        if not self.config.shared_scores:
            raise ValueError("released_scores needs a feature spec v3 artifact (head-shared scores)")
        special = special_mask(token_ids, self.config.special_token_ids)
        feats, _, _ = compute_features_v3(queries, keys, values, query_pos, key_pos, seq_len, self.key_geometry(),
                                          layer, scaling, phase, special)  # fmt: skip
        return self.indexer.scores(layer, feats[None])[0]

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained`` with the memory's weights stored in ``config.memory_dtype``."""
        dtype = STORAGE_DTYPES[self.config.memory_dtype]
        if dtype == torch.float32:
            return super().save_pretrained(save_directory, *args, **kwargs)
        original = next(self.memory.parameters()).dtype
        self.memory.to(dtype)
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.memory.to(original)

    # ---------------------------------------------------------------------------------------------------------
    # Geometry and statistics

    @torch.no_grad()
    def set_geometry(self, geometry: Geometry) -> None:
        check_fingerprint(geometry.fingerprint, self.config.fingerprint, "geometry")
        for name in ("mean", "proj", "prototypes", "gamma", "kmm_inv_sqrt"):
            src, dst = getattr(geometry, name), getattr(self, f"geo_{name}")
            if src.shape != dst.shape:
                raise ValueError(f"geometry {name} {tuple(src.shape)} vs artifact {tuple(dst.shape)}")
            dst.copy_(src)

    def geometry(self) -> Geometry:
        """The stage-0 geometry stored in the artifact (the features need it)."""
        t = [getattr(self, f"geo_{k}").detach() for k in ("mean", "proj", "prototypes", "gamma", "kmm_inv_sqrt")]
        return Geometry(*t, fingerprint=dict(self.config.fingerprint))

    # ---------------------------------------------------------------------------------------------------------
    # Base-model checks

    def check_base_model(self, model: nn.Module) -> None:
        """Raise :class:`~core_kv.teacher.geometry.FingerprintMismatch` if ``model`` is not the base it was trained on.

        Layers, heads, KV heads, head dim and the key-projection digest must all match; the name/revision may
        differ (a local copy of the same weights is fine).
        """
        fp = model_fingerprint(model)
        stored = dict(self.config.fingerprint)
        keys = ("layers", "heads", "kv_heads", "head_dim", "model_type", "k_proj_digest")
        check_fingerprint({k: stored.get(k) for k in keys}, {k: fp.get(k) for k in keys}, "CORE checkpoint")

    @classmethod
    def from_pretrained(cls, path, *args, base_model: nn.Module | None = None, **kwargs) -> CoreModel:
        """Load an artifact folder offline; with ``base_model`` also check it matches (clear error if not).

        A local folder is checked first, naming the file: ``config.json``'s settings (counts, protected positions,
        write rule) and every tensor of ``model.safetensors`` (present, the shape the config implies, finite).
        """
        kwargs.setdefault("local_files_only", True)
        if Path(path).is_dir():
            check_artifact(Path(path))
        elif Path(path).exists():
            raise FileNotFoundError(f"{path} is a file; a CORE artifact is a folder (config.json + model.safetensors)")
        elif looks_local(str(path)):
            raise FileNotFoundError(
                f"CORE artifact folder {path} does not exist (expected config.json + model.safetensors)"
            )
        try:
            core = super().from_pretrained(path, *args, **kwargs)
        except OSError as e:  # a hub id that is not in the local cache (or cannot be downloaded)
            if Path(path).is_dir():
                raise
            raise FileNotFoundError(
                f"CORE artifact {str(path)!r}: no such folder, and no hub model of that id could be loaded "
                f"(local_files_only={kwargs['local_files_only']}): {str(e).splitlines()[0]}"
            ) from e
        if core.config.artifact_version != ARTIFACT_VERSION:
            raise ValueError(f"{path}: artifact v{core.config.artifact_version}, this code reads v{ARTIFACT_VERSION}")
        differ = spec_differences(core.config.feature_spec)
        if differ:  # other version, names or constants: the press would compute other features than it learned on
            raise ValueError(
                f"{path}: trained with {differ}; this code computes feature specs {sorted(FEATURE_SPECS)} with "
                "their recorded constants; retrain with `accelerate launch train.py`"
            )
        if base_model is not None:
            core.check_base_model(base_model)
        core.memory.float()  # stored in config.memory_dtype, computed in float32
        return core.eval()

    def policy(self) -> InferencePolicy:
        """The recorded inference policy (when none is recorded: the paper's press for every ratio, without the memory
        if it was never trained)."""
        if self.config.inference_policy is None:
            if self.config.memory_trained:
                return InferencePolicy.single(PAPER, validation={"note": "no policy recorded: the paper's press"})
            note = "no policy recorded, no trained memory: the paper's scorer without the memory"
            return InferencePolicy.single(PolicyOptions(memory=False), validation={"note": note})
        where = f"{self.config.name_or_path}/config.json: inference_policy" if self.config.name_or_path else None
        policy = InferencePolicy.from_dict(self.config.inference_policy, where or "inference_policy")
        policy.check_layers(self.config.num_layers, where or "inference_policy")
        return policy

    def num_parameters_by_part(self) -> dict:
        return {
            "indexer": sum(p.numel() for p in self.indexer.parameters()),
            "memory": sum(p.numel() for p in self.memory.parameters()),
        }


def check_artifact(path: Path) -> None:
    """Raise ``ValueError`` naming the file when an artifact folder's config or tensors are unusable."""
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file():
        raise ValueError(
            f"{path} is not a CORE artifact folder: no config.json (expected config.json + model.safetensors)"
        )
    try:
        stored = json.loads(cfg_file.read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{cfg_file}: unreadable CORE config ({e})") from None
    if not isinstance(stored, dict):
        raise ValueError(f"{cfg_file}: not a CORE config (a JSON object), got a {type(stored).__name__}")
    model_type = stored.get("model_type")
    if model_type != CoreConfig.model_type:
        raise ValueError(
            f"{path} is not a CORE artifact (config.json model_type {model_type!r}, expected 'core_kv'): a base "
            "model folder? CORE artifacts are the final/ folders train.py writes"
        )
    if not isinstance(stored.get("feature_spec"), dict) or "version" not in stored["feature_spec"]:
        # CoreConfig would default it to the current spec, and the press would compute features it never learned on
        raise ValueError(f"{cfg_file}: no feature_spec field with a version (got {stored.get('feature_spec')!r}); every "
                         "artifact train.py writes records it (a v1 artifact too): a damaged or hand-made config")  # fmt: skip
    try:
        config = CoreConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{cfg_file}: invalid CORE config ({e})") from e
    for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "d_z", "num_prototypes", "memory_dim",
                 "chunk_size", "protected_sinks", "protected_recent"):  # fmt: skip
        v, low = getattr(config, name, None), 0 if name.startswith("protected") else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{cfg_file}: {name} must be an integer >= {low}, got {v!r}")
    if config.inference_policy is not None:
        policy = InferencePolicy.from_dict(config.inference_policy, f"{cfg_file}: inference_policy")
        policy.check_layers(config.num_layers, f"{cfg_file}: inference_policy")
    if config.num_heads % config.num_kv_heads:
        raise ValueError(f"{cfg_file}: num_heads ({config.num_heads}) must be a multiple of num_kv_heads")
    if not weights.is_file():
        return  # a sharded or hub layout: transformers reports what is missing
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in CoreModel(config).state_dict().items()}
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            stored = set(f.keys())
            for key in sorted(stored & set(expected)):
                t = f.get_tensor(key)
                if tuple(t.shape) != expected[key]:
                    raise ValueError(
                        f"{weights}: tensor {key} has shape {tuple(t.shape)}, {cfg_file.name} implies {expected[key]}"
                    )
                if t.is_floating_point() and not torch.isfinite(t).all():
                    raise ValueError(f"{weights}: tensor {key} holds NaN/Inf values (a corrupt or diverged artifact)")
    except ValueError:
        raise
    except Exception as e:  # safetensors' own errors (truncated file, bad header) name no path
        raise ValueError(f"{weights}: unreadable ({type(e).__name__}: {e})") from e
    missing, extra = sorted(set(expected) - stored), sorted(stored - set(expected))
    if missing or extra:
        raise ValueError(
            f"{weights}: missing tensors {missing[:5]}, unexpected tensors {extra[:5]} for {cfg_file.name}"
        )


__all__ = ["ARTIFACT_VERSION", "CoreConfig", "CoreModel", "FingerprintMismatch", "check_artifact"]
