"""The CORE artifact, PreTrainedModel-style (CORE.md stages 2–4): :class:`CoreConfig` + :class:`CoreModel`.

:class:`CoreModel` (``checkpoints/<run>/final/``) is ``config.json`` + ``model.safetensors`` with the indexer
(:mod:`core_kv.indexer`), the temperatures, the latent memory and gate (:mod:`core_kv.memory`), the stage-0 geometry,
the feature statistics and the base-model fingerprint. Load it offline with ``CoreModel.from_pretrained(path)``; pass
``base_model=`` to refuse a different base model (layers, heads, head dim or weights digest) with a clear error.

Artifact kinds are chosen by ``config.json``'s ``model_type``, as transformers' ``AutoConfig`` does:
:data:`ARTIFACTS` maps each to its class (``core_kv`` -> :class:`CoreModel`; a plugin adds its own with
:func:`register_artifact`, e.g. ``research.released``'s ``core_kv_released``) and :func:`load_artifact` loads a folder
of any registered kind. :class:`ArtifactModel` is what every kind shares: loading with named errors, the base-model
check and the recorded inference policy.

Shapes: L layers, H query heads, Hkv KV heads, D head dim, F = 14 features, d_z projected key dim, M prototypes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from core_kv.features import FEATURE_SPECS, spec, spec_differences
from core_kv.files import read_json_object
from core_kv.geometry import Geometry
from core_kv.indexer import CoreIndexer
from core_kv.memory import MEMORY_DIM, WRITE_RULES, LatentMemory
from core_kv.models.fingerprint import FingerprintMismatch, check_fingerprint, model_fingerprint
from core_kv.models.loading import looks_local, quiet_loading
from core_kv.policy import PAPER, InferencePolicy, check_recipe_search

ARTIFACT_VERSION = 1


class ArtifactConfig(PretrainedConfig):
    """What the config of every artifact kind holds; a kind subclasses it with its ``model_type``, its own settings
    and its defaults (:class:`CoreConfig`; a plugin's, e.g. ``research.released.ReleasedConfig``).

    Args:
        num_layers, num_heads, num_kv_heads, head_dim: Base-model attention geometry.
        d_z, num_prototypes: The key geometry's sizes.
        memory_dim: P, the memory's size.
        protected_sinks, protected_recent: Tokens always kept at an event (inside B).
        chunk_size: The chunk (or sequence) length the artifact was trained on.
        fingerprint: :func:`~core_kv.models.fingerprint.model_fingerprint` of the base model.
        feature_spec: The feature spec at training time.
        teacher: The teacher's settings.
        inference_policy: The composition to run per (validated context length, compression-ratio band), chosen by
            ``train.py``'s policy stage (:class:`~core_kv.policy.InferencePolicy` as a dict); ``None``: the kind's
            default press.
        artifact_version: :data:`ARTIFACT_VERSION` when written.
    """

    # the integer settings check_artifact refuses by name when missing or below their floor (protected_*: 0, else 1)
    sizes = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "d_z", "num_prototypes", "memory_dim",
             "chunk_size", "protected_sinks", "protected_recent")  # fmt: skip

    def __init__(
        self,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 16,
        d_z: int = 16,
        num_prototypes: int = 64,
        memory_dim: int = MEMORY_DIM,
        protected_sinks: int = 4,
        protected_recent: int = 32,
        chunk_size: int = 512,
        fingerprint: dict | None = None,
        feature_spec: dict | None = None,
        teacher: dict | None = None,
        inference_policy: dict | None = None,
        artifact_version: int = ARTIFACT_VERSION,
        **kwargs,
    ):
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = (
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        self.d_z, self.num_prototypes, self.memory_dim = d_z, num_prototypes, memory_dim
        self.protected_sinks, self.protected_recent, self.chunk_size = protected_sinks, protected_recent, chunk_size
        self.fingerprint = fingerprint or {}
        self.feature_spec = feature_spec or {}
        self.teacher = teacher or {}
        self.inference_policy = inference_policy
        self.artifact_version = artifact_version
        super().__init__(**kwargs)


class CoreConfig(ArtifactConfig):
    """Geometry of the base model and the CORE settings an artifact was trained with (the shared fields:
    :class:`ArtifactConfig`).

    Args:
        d_z, num_prototypes: Stage-0 geometry sizes (paper: 64, 64); memory_dim: P (512, paper Table 9);
            chunk_size: the prefill chunk the indexer was trained on; teacher: the teacher's parameters (λ, R0, …)
            from its manifest.
        write_rule: ``mass`` | ``equal_event`` | ``uniform_token`` (CORE.md stage 4).
        feature_spec: :func:`core_kv.features.spec` at training time (the default).
        inference_policy: ``None``: the paper's press.
        trained_selection: The retained sets the indexer and the memory were trained under (``train.py``'s
            ``selection``): ``per_head`` (every artifact before the option) or ``shared`` (one set per layer shared by
            the KV heads, what ``head_shared`` serves).
        **kwargs: :class:`ArtifactConfig`'s fields.
    """

    model_type = "core_kv"

    def __init__(
        self,
        write_rule: str = "mass",
        feature_spec: dict | None = None,
        trained_selection: str = "per_head",
        **kwargs,
    ):
        if write_rule not in WRITE_RULES:
            raise ValueError(f"write_rule must be one of {WRITE_RULES}, got {write_rule!r}")
        if trained_selection not in ("per_head", "shared"):
            raise ValueError(f"trained_selection must be 'per_head' or 'shared', got {trained_selection!r}")
        self.write_rule = write_rule
        self.trained_selection = trained_selection
        super().__init__(feature_spec=feature_spec or spec(), **kwargs)

    @classmethod
    def for_model(cls, model: nn.Module, geometry: Geometry, **kwargs) -> CoreConfig:
        """A config matching ``model`` (dims and fingerprint) and ``geometry`` (d_z, M)."""
        fp = model_fingerprint(model)
        return cls(
            num_layers=fp["layers"], num_heads=fp["heads"], num_kv_heads=fp["kv_heads"], head_dim=fp["head_dim"],
            d_z=geometry.proj.shape[-2], num_prototypes=geometry.num_prototypes, fingerprint=fp, **kwargs,
        )  # fmt: skip


ARTIFACTS: dict[str, type[ArtifactModel]] = {}  # config.json model_type -> the artifact class (register_artifact)


class ArtifactModel(PreTrainedModel):
    """What every CORE artifact kind shares: offline loading with named errors (:meth:`from_pretrained`), the
    base-model check and the recorded inference policy. A kind sets ``config_class`` (with its own ``model_type``,
    ``sizes`` and ``inference_policy``) and :meth:`spec_problem`, and is registered with :func:`register_artifact`."""

    base_model_prefix = "core"
    main_input_name = "features"

    def _init_weights(self, module: nn.Module) -> None:  # weights are initialised by the modules themselves
        pass

    @classmethod
    def spec_problem(cls, feature_spec: dict) -> str:
        """How ``feature_spec`` differs from what this code computes (``""``: it does not)."""
        differ = spec_differences(feature_spec)
        return differ and f"trained with {differ}; this code computes feature specs {sorted(FEATURE_SPECS)}"

    # ---------------------------------------------------------------------------------------------------------
    # Base-model checks

    def check_base_model(self, model: nn.Module) -> None:
        """Raise :class:`~core_kv.geometry.FingerprintMismatch` if ``model`` is not the base it was trained on.

        Layers, heads, KV heads, head dim and the key-projection digest must all match; the name/revision may
        differ (a local copy of the same weights is fine).
        """
        fp = model_fingerprint(model)
        stored = dict(self.config.fingerprint)
        keys = ("layers", "heads", "kv_heads", "head_dim", "model_type", "k_proj_digest")
        check_fingerprint({k: stored.get(k) for k in keys}, {k: fp.get(k) for k in keys}, "CORE checkpoint")

    @classmethod
    def from_pretrained(cls, path, *args, base_model: nn.Module | None = None, **kwargs):
        """Load an artifact folder offline; with ``base_model`` also check it matches (clear error if not).

        A local folder is checked first, naming the file: ``config.json``'s kind and settings (counts, protected
        positions) and every tensor of ``model.safetensors`` (present, the shape the config implies, finite).
        """
        kwargs.setdefault("local_files_only", True)
        if Path(path).is_dir():
            check_artifact(Path(path), cls)
        elif Path(path).exists():
            raise FileNotFoundError(f"{path} is a file; a CORE artifact is a folder (config.json + model.safetensors)")
        elif looks_local(str(path)):
            raise FileNotFoundError(
                f"CORE artifact folder {path} does not exist (expected config.json + model.safetensors)"
            )
        try:
            with quiet_loading():  # one press per candidate: no "Loading weights" bar for each
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
        problem = cls.spec_problem(core.config.feature_spec)
        if problem:  # other version, names or constants: the press would compute other features than it learned on
            raise ValueError(
                f"{path}: {problem} with their recorded constants; retrain with `accelerate launch train.py`"
            )
        if base_model is not None:
            core.check_base_model(base_model)
        core.memory.float()  # computed in float32 (a kind may store it in another dtype)
        return core.eval()

    def policy(self) -> InferencePolicy:
        """The recorded inference policy (when none is recorded: the paper's press for every ratio)."""
        if self.config.inference_policy is None:
            return InferencePolicy.single(PAPER, validation={"note": "no policy recorded: the paper's press"})
        where = f"{self.config.name_or_path}/config.json: inference_policy" if self.config.name_or_path else None
        policy = InferencePolicy.from_dict(self.config.inference_policy, where or "inference_policy")
        policy.check_layers(self.config.num_layers, where or "inference_policy")
        return policy

    def num_parameters_by_part(self) -> dict:
        return {
            "indexer": sum(p.numel() for p in self.indexer.parameters()),
            "memory": sum(p.numel() for p in self.memory.parameters()),
        }


class CoreModel(ArtifactModel):
    """The CORE artifact: indexer + temperatures + latent memory/gate + geometry + feature statistics.

    Example::

        core = CoreModel.from_pretrained("checkpoints/core-proxy/final", base_model=model)
        s = core.indexer.scores(layer, features)                  # (Hkv, N)
        p = core.indexer.distribution(layer, s)                   # calibrated
        state = core.memory.write(state, layer, k_pre, v, write_weights(p, evicted, core.config.write_rule))
    """

    config_class = CoreConfig

    def __init__(self, config: CoreConfig):
        super().__init__(config)
        c = config
        self.indexer = CoreIndexer(c.num_layers, c.num_kv_heads)
        self.memory = LatentMemory(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.memory_dim)
        m = c.num_prototypes
        self.register_buffer("geo_mean", torch.zeros(c.num_layers, c.num_kv_heads, c.head_dim))
        self.register_buffer("geo_proj", torch.zeros(c.num_layers, c.num_kv_heads, c.d_z, c.head_dim))
        self.register_buffer("geo_prototypes", torch.zeros(c.num_layers, c.num_kv_heads, m, c.d_z))
        self.register_buffer("geo_gamma", torch.ones(c.num_layers, c.num_kv_heads))
        self.register_buffer("geo_kmm_inv_sqrt", torch.zeros(c.num_layers, c.num_kv_heads, m, m))
        self.post_init()

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


def register_artifact(model_class: type[ArtifactModel]) -> type[ArtifactModel]:
    """Register an artifact class under its config's ``model_type`` (a plugin calls this when imported)."""
    ARTIFACTS[model_class.config_class.model_type] = model_class
    return model_class


register_artifact(CoreModel)


def kind_error(path: Path, model_type, plugin=None, expected: str = CoreConfig.model_type) -> str:
    """Why the folder ``path`` (of config.json ``model_type``, defined by the module ``plugin`` if recorded) is not
    an artifact of ``expected``: another registered kind, a plugin's kind whose module is not imported, or no CORE
    artifact at all."""
    if model_type in ARTIFACTS:
        cls = ARTIFACTS[model_type]
        return (f"{path} is a {model_type!r} artifact ({cls.__module__}.{cls.__name__}), not a {expected!r} one: load "
                f"it with its own class or press (core_kv.core_model.load_artifact picks the class)")  # fmt: skip
    if plugin:
        return (f"{path}: config.json model_type {model_type!r} is defined by the plugin module {plugin!r}, which is "
                f"not imported: `import {plugin}` first (in a train or eval config: plugins: [{plugin}])")  # fmt: skip
    return (f"{path} is not a CORE artifact (config.json model_type {model_type!r}; registered kinds "
            f"{sorted(ARTIFACTS)}): a base model folder? CORE artifacts are the final/ folders train.py writes")  # fmt: skip


def _stored_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(
            f"{path} is not a CORE artifact folder: no config.json (expected config.json + model.safetensors)"
        )
    return read_json_object(cfg_file, "CORE config")


def artifact_config(path) -> PretrainedConfig:
    """The config of the artifact folder ``path``, read with the config class its ``model_type`` names."""
    stored = _stored_config(Path(path))
    cls = ARTIFACTS.get(stored.get("model_type"))
    if cls is None:
        raise ValueError(kind_error(Path(path), stored.get("model_type"), stored.get("plugin"), "registered"))
    return cls.config_class.from_pretrained(path, local_files_only=True)


def load_artifact(path, **kwargs) -> ArtifactModel:
    """Load the artifact folder ``path`` with the class its ``config.json`` ``model_type`` names (:data:`ARTIFACTS`);
    ``kwargs`` as :meth:`ArtifactModel.from_pretrained`. An unregistered kind is refused naming the module to import."""
    stored = _stored_config(Path(path))
    cls = ARTIFACTS.get(stored.get("model_type"))
    if cls is None:
        raise ValueError(kind_error(Path(path), stored.get("model_type"), stored.get("plugin"), "registered"))
    return cls.from_pretrained(path, **kwargs)


def check_artifact(path: Path, model_class: type[ArtifactModel] = CoreModel) -> None:
    """Raise ``ValueError`` naming the file when an artifact folder's config or tensors are unusable for
    ``model_class``."""
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    stored = _stored_config(path)
    config_class = model_class.config_class
    model_type = stored.get("model_type")
    if model_type != config_class.model_type:
        raise ValueError(kind_error(path, model_type, stored.get("plugin"), config_class.model_type))
    if not isinstance(stored.get("feature_spec"), dict) or "version" not in stored["feature_spec"]:
        # the config would default it to the current spec, and the press would compute features it never learned on
        raise ValueError(f"{cfg_file}: no feature_spec field with a version (got {stored.get('feature_spec')!r}); every "
                         "artifact train.py writes records it (a v1 artifact too): a damaged or hand-made config")  # fmt: skip
    try:
        config = config_class.from_pretrained(path, local_files_only=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{cfg_file}: invalid CORE config ({e})") from e
    for name in config_class.sizes:
        v, low = getattr(config, name, None), 0 if name.startswith("protected") else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{cfg_file}: {name} must be an integer >= {low}, got {v!r}")
    if config.inference_policy is not None:
        policy = InferencePolicy.from_dict(config.inference_policy, f"{cfg_file}: inference_policy")
        policy.check_layers(config.num_layers, f"{cfg_file}: inference_policy")
    if stored.get("recipe_search") is not None:  # the recipe search that chose this artifact's training recipe
        check_recipe_search(stored["recipe_search"], f"{cfg_file}: recipe_search")
    if config.num_heads % config.num_kv_heads:
        raise ValueError(f"{cfg_file}: num_heads ({config.num_heads}) must be a multiple of num_kv_heads")
    if not weights.is_file():
        return  # a sharded or hub layout: transformers reports what is missing
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model_class(config).state_dict().items()}
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


__all__ = ["ARTIFACTS", "ARTIFACT_VERSION", "ArtifactModel", "CoreConfig", "CoreModel", "FingerprintMismatch",
           "artifact_config", "check_artifact", "load_artifact", "register_artifact"]  # fmt: skip
