"""The released recipe's artifact: :class:`ReleasedConfig` (``model_type`` ``core_kv_released``) + :class:`ReleasedModel`.

A folder like CORE's (``config.json`` + ``model.safetensors``), another architecture: one indexer score per token per
layer (head-shared), the fixed key geometry (:class:`~research.released.geometry.KeyGeometry`: ``key_projection``,
``key_prototypes``, ``key_rotation``) and the fast memory (:class:`~research.released.memory.FastMemory`, one state per
layer). Importing :mod:`research.released` registers the class (:func:`core_kv.core_model.register_artifact`), so
:func:`core_kv.core_model.load_artifact` loads either kind by ``model_type``; ``config.json`` also names the module
(``plugin``), so loading one without it says what to import.

Shapes: L layers, H query heads, Hkv KV heads, D head dim, d_z projected key dim, M prototypes.
"""

from __future__ import annotations

import torch

from core_kv.core_model import ArtifactConfig, ArtifactModel, register_artifact
from core_kv.indexer import CoreIndexer
from core_kv.policy import InferencePolicy, PolicyOptions
from research.released.features import SPEC, compute_features_v3, spec_problem, special_mask
from research.released.geometry import D_Z, NUM_PROTOTYPES, KeyGeometry
from research.released.memory import DECAY, GATE_HIDDEN, KERNELS, MEMORY_DIM, READOUTS, FastMemory

PLUGIN = "research.released"
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ReleasedConfig(ArtifactConfig):
    """Geometry of the base model and the settings a released-recipe artifact was trained with (the shared fields:
    :class:`core_kv.core_model.ArtifactConfig`).

    Args:
        d_z, num_prototypes: The fixed key geometry's sizes (64, 64); memory_dim: P of the fast memory (512);
            chunk_size: the longest training sequence; teacher: the recipe's teacher settings (DRIVE constants,
            sinks, budgets).
        protected_recent: Recent tokens always kept at an event (none by default).
        feature_spec: :data:`research.released.features.SPEC` at training time (the default).
        inference_policy: The composition per compression-ratio band (memory on, off or in some layers), chosen by
            ``train.py``'s policy stage; ``None``: the scorer with the memory in every layer.
        memory_gate_hidden, memory_decay: The fast memory's gate width and decay γ across events.
        memory_readout: ``residual`` (the release: ``o_R + g m``) or ``interpolate`` (``o_R + g (m − o_R)``).
        memory_kernel: ``released`` (signed) or ``positive`` (:func:`research.released.memory.read`).
        memory_dtype: Storage dtype of the memory's weights in ``model.safetensors``; computed in float32 after loading.
        special_token_ids: Token ids the ``sink`` feature flags (the tokenizer's special tokens).
        ablated_features: Feature names the indexer never sees (zeroed at its input).
        memory_trained: False for an artifact whose memory was never trained (``released.memory.train=false``): its
            default policy runs no memory, and a press that asks for the memory is refused.
    """

    model_type = "core_kv_released"

    def __init__(
        self,
        d_z: int = D_Z,
        num_prototypes: int = NUM_PROTOTYPES,
        memory_dim: int = MEMORY_DIM,
        protected_recent: int = 0,
        chunk_size: int = 4096,
        feature_spec: dict | None = None,
        memory_gate_hidden: int = GATE_HIDDEN,
        memory_decay: float = DECAY,
        memory_readout: str = "residual",
        memory_kernel: str = "released",
        memory_dtype: str = "float32",
        special_token_ids: list[int] | None = None,
        ablated_features: list[str] | None = None,
        memory_trained: bool = True,
        **kwargs,
    ):
        for name, value, choices in (("memory_kernel", memory_kernel, KERNELS), ("memory_readout", memory_readout,
                                     READOUTS), ("memory_dtype", memory_dtype, tuple(STORAGE_DTYPES))):  # fmt: skip
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        feature_spec = feature_spec or dict(SPEC)
        self.memory_gate_hidden, self.memory_decay = memory_gate_hidden, memory_decay
        self.memory_readout, self.memory_kernel, self.memory_dtype = memory_readout, memory_kernel, memory_dtype
        self.special_token_ids = list(special_token_ids or [])
        self.ablated_features = list(ablated_features or [])
        self.memory_trained = bool(memory_trained)
        self.plugin = PLUGIN  # the module that defines this kind (named when it is loaded without it)
        kwargs.pop("plugin", None)
        unknown = sorted(set(self.ablated_features) - set(feature_spec.get("names") or []))
        if unknown:
            raise ValueError(f"ablated_features {unknown} are not in the feature spec's names "
                             f"{list(feature_spec.get('names') or [])}")  # fmt: skip
        super().__init__(d_z=d_z, num_prototypes=num_prototypes, memory_dim=memory_dim, protected_recent=protected_recent,
                         chunk_size=chunk_size, feature_spec=feature_spec, **kwargs)  # fmt: skip


class ReleasedIndexer(CoreIndexer):
    """The indexer with one score per token (a single "KV head") and, for one-choice ablations, features it never
    sees: ``ablated`` indices are zeroed after standardisation, in training and at inference alike."""

    def __init__(self, num_layers: int, ablated: list[int] | None = None):
        super().__init__(num_layers, 1)
        self.ablated = sorted(int(i) for i in ablated or [])

    def standardize(self, layer: int, features: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        x = super().standardize(layer, features, heads)
        return x.index_fill(-1, torch.tensor(self.ablated, device=x.device), 0.0) if self.ablated else x


class ReleasedModel(ArtifactModel):
    """The released artifact: head-shared indexer + temperatures, the fast memory and gate, the fixed key geometry."""

    config_class = ReleasedConfig

    def __init__(self, config: ReleasedConfig):
        super().__init__(config)
        c = config
        self.indexer = ReleasedIndexer(c.num_layers, [c.feature_spec["names"].index(n) for n in c.ablated_features])
        self.memory = FastMemory(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.memory_dim,
                                 c.memory_gate_hidden, c.memory_readout, c.memory_kernel)  # fmt: skip
        self.register_buffer("key_projection", torch.zeros(c.num_layers, c.d_z, c.num_kv_heads * c.head_dim))
        self.register_buffer("key_prototypes", torch.zeros(c.num_prototypes, c.d_z))
        self.register_buffer("key_rotation", torch.zeros(c.d_z, c.d_z))
        self.post_init()

    @classmethod
    def spec_problem(cls, feature_spec: dict) -> str:
        return spec_problem(feature_spec)

    @torch.no_grad()
    def set_key_geometry(self, geometry: KeyGeometry) -> None:
        """Store the fixed key geometry."""
        for name, src in (("projection", geometry.projection), ("prototypes", geometry.prototypes),
                          ("rotation", geometry.rotation)):  # fmt: skip
            dst = getattr(self, f"key_{name}")
            if src.shape != dst.shape:
                raise ValueError(f"key geometry {name} {tuple(src.shape)} vs artifact {tuple(dst.shape)}")
            dst.copy_(src)

    def key_geometry(self) -> KeyGeometry:
        """The fixed key geometry stored in the artifact."""
        return KeyGeometry(self.key_projection.detach(), self.key_prototypes.detach(), self.key_rotation.detach())

    @torch.no_grad()
    def scores(
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
        """One score per candidate (N,) at one event of ``layer``, shared by the KV heads.

        Args:
            queries: The event's post-RoPE queries (H, T, D) at ``query_pos`` (T,) (every prefill query; the last
                decode interval's queries at a decode event).
            keys, values: The cached post-RoPE keys and values (Hkv, N, D) at ``key_pos`` (N,).
            seq_len: Tokens processed so far (the uncompressed length).
            scaling: The attention module's score scale.
            phase: 0 at a prefill event, 1 at a decode event.
            token_ids: The candidates' token ids (N,), for the special-token flag (``None``: sinks only).
        """
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

    def policy(self) -> InferencePolicy:
        """The recorded policy; when none is recorded, the memory in every layer (none if it was never trained)."""
        if self.config.inference_policy is None and not self.config.memory_trained:
            note = "no policy recorded, no trained memory: the scorer without the memory"
            return InferencePolicy.single(PolicyOptions(memory=False), validation={"note": note})
        return super().policy()


register_artifact(ReleasedModel)

__all__ = ["PLUGIN", "ReleasedConfig", "ReleasedIndexer", "ReleasedModel"]
