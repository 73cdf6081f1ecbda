"""CORE's error certificate as an observer of the latent memory (a diagnostic, outside the product press).

Paper 002: a "four-term pre-compensation error certificate"; the terms are this project's reconstruction
(``../shared/design/CORE.md`` "Certificate"). :class:`CertifiedMemoryPress` is the latent memory that also keeps a
shadow copy of every evicted K/V (not counted in ``aux_bytes``) and, at every readout, logs per (layer, query head)
the certificate terms, the true retention error and the compensated error (:attr:`CertifiedMemoryPress.certificates`;
paper Tables 6, 8); ``write_noise`` perturbs each event's write weights (paper Table 8's ``G^(δ)``).
``build_press("core_certified", checkpoint=..., ...)`` (registered when this module is imported) is the ``core``
press whose stack has this memory outermost instead of the latent memory. Used by ``research/core_audit.py`` and ``research/answer_likelihood.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core_kv.models.attention import apply_rope
from core_kv.presses.core import CorePress
from core_kv.presses.latent_memory import LatentMemoryPress, MemoryLayer


def certificate_terms(
    eps_hat: torch.Tensor, delta: torch.Tensor | float, centroid: torch.Tensor, radius: torch.Tensor, o_r: torch.Tensor
) -> torch.Tensor:
    """The four-term pre-compensation bound ``‖o* − o_R‖ ≤ ε̂‖c_E − o_R‖ + ε̂ r_E + δ‖c_E − o_R‖ + δ r_E``.

    From the exact identity ``o* − o_R = α_E (o_E − o_R)`` [paper]: ``‖o_E − o_R‖ ≤ ‖c_E − o_R‖ + r_E`` whenever
    ``r_E ≥ ‖o_E − c_E‖`` (true for ``r_E = max_{i∈E} ‖v_i − c_E‖``: ``o_E`` is a convex combination of evicted
    values) and ``α_E ≤ ε̂ + δ`` whenever ``δ ≥ |α_E − ε̂|``.

    Args:
        eps_hat: Predicted evicted mass ε̂ (...).
        delta: Calibration error bound δ (... or scalar).
        centroid: Write-weighted evicted centroid c_E (..., D).
        radius: r_E (...).
        o_r: Retained output o_R (..., D).

    Returns:
        The four terms stacked on the last dim (..., 4); their sum is the bound.
    """
    gap = (centroid.float() - o_r.float()).norm(dim=-1)
    delta = torch.as_tensor(delta, dtype=gap.dtype, device=gap.device)
    eps_hat, radius = eps_hat.to(gap), radius.to(gap)
    return torch.stack(torch.broadcast_tensors(eps_hat * gap, eps_hat * radius, delta * gap, delta * radius), -1)


@dataclass
class CertifiedMemoryPress(LatentMemoryPress, name="latent_memory_certified"):
    """The latent memory, logging the certificate at every readout.

    Args:
        certificate_delta: δ of the online certificate (paper Table 8 uses δ = 0.05).
        write_noise: Perturb each event's write weights by ``(1 + write_noise · ξ_e)``, ``ξ_e = ±1`` seeded per
            (layer, event): the mass perturbation of paper Table 8's ``G^(δ)`` (0 = off).

    Attributes:
        certificates: One dict per (layer, forward after its first event) of the last context, per query head: ε̂,
            α_E, gate, RetErr, compensated error, the four terms, bounds, hold rates.
    """

    certificate_delta: float = 0.05
    write_noise: float = 0.0

    sink_log_partition = False  # the certificate needs the post-RoPE queries: the log-partition is recomputed
    certificates: list = field(default_factory=list, init=False, repr=False, compare=False)
    _shadow: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _sign: float = field(default=1.0, init=False, repr=False, compare=False)

    def validate(self) -> None:
        super().validate()
        if not (isinstance(self.certificate_delta, (int, float)) and self.certificate_delta >= 0):
            raise ValueError(f"certificate_delta must be >= 0, got {self.certificate_delta!r}")
        if not (isinstance(self.write_noise, (int, float)) and 0 <= self.write_noise < 1):
            raise ValueError(f"write_noise must be in [0, 1), got {self.write_noise!r}")

    def before_forward(self, module, hs, cache, kwargs) -> None:
        if self._state.get(module.layer_idx, {}).get("empty_before"):
            self._shadow.pop(module.layer_idx, None)
            if module.layer_idx == 0:  # a new context: the log describes the last context only
                self.certificates.clear()
        super().before_forward(module, hs, cache, kwargs)

    @torch.no_grad()
    def evicted(self, module, keys, values, kept, lengths=None) -> None:
        """Shadow every evicted (post-RoPE) key and value, right-padded per head to the longest head's."""
        idx = module.layer_idx
        if idx in self._memory:
            n = keys.shape[2]
            lens = torch.full((keys.shape[1],), n) if lengths is None else lengths.cpu()
            heads = kept[0] if isinstance(kept, torch.Tensor) else kept
            ev = [sorted(set(range(int(lens[h]))) - set(heads[h].tolist())) for h in range(keys.shape[1])]
            width = max(len(e) for e in ev)
            if width:
                idx_t = torch.tensor([e + [0] * (width - len(e)) for e in ev], device=keys.device)  # (Hkv, E)
                valid = torch.arange(width, device=keys.device)[None] < torch.tensor([len(e) for e in ev])[:, None]
                g = idx_t[..., None].expand(-1, -1, keys.shape[-1])
                new = (keys[0].gather(1, g), values[0].gather(1, g), valid.to(keys.device))
                old = self._shadow.get(idx)
                self._shadow[idx] = (
                    new if old is None else tuple(torch.cat([a, b], 1) for a, b in zip(old, new, strict=True))
                )
        super().evicted(module, keys, values, kept, lengths)

    def write(self, module, st: MemoryLayer, keys, values, kept) -> None:
        events = 0 if st.mem is None else st.mem.events
        gen = torch.Generator().manual_seed(1000 * module.layer_idx + events)
        self._sign = 1.0 if torch.rand((), generator=gen) < 0.5 else -1.0
        super().write(module, st, keys, values, kept)

    def write_weights(self, layer: int, p: torch.Tensor, evicted: torch.Tensor) -> torch.Tensor:
        w = super().write_weights(layer, p, evicted)
        return w * (1 + self.write_noise * self._sign) if self.write_noise else w

    def observe(self, module, st: MemoryLayer, q_pre, o_r, o_hat, gate, lse_r) -> None:
        """True retention error vs the four-term bound, per query head (averaged over this forward's queries)."""
        shadow = self._shadow.get(module.layer_idx)
        if shadow is None:
            return
        q_post = apply_rope(module, q_pre[None], st.fwd["position_embeddings"])[0].float()
        h, t, d = q_post.shape
        ek, ev, valid = shadow  # (Hkv, E, D) post-RoPE keys and values of every evicted entry; (Hkv, E) mask
        hkv = ek.shape[0]
        gq = h // hkv
        scaling = float(getattr(module, "scaling", d**-0.5))
        logits_e = (q_post.view(hkv, gq, t, d) @ ek.float()[:, None].mT) * scaling  # (Hkv, G, T, E)
        logits_e = logits_e.masked_fill(~valid[:, None, None], float("-inf"))  # a head's padding
        lse_e = logits_e.logsumexp(-1).reshape(h, t)  # -inf for a head that evicted nothing: α = 0 below
        alpha = (lse_e - torch.logaddexp(lse_r, lse_e)).exp()  # true evicted mass α_E(q)
        o_e = (logits_e.softmax(-1).nan_to_num(0.0) @ ev.float()[:, None]).reshape(h, t, d)
        o_star = o_r + alpha[..., None] * (o_e - o_r)  # the identity, exact: o* = (S_R o_R + S_E o_E) / S
        mem = st.mem
        rep = lambda x: x.repeat_interleave(gq, 0)  # noqa: E731  (KV head -> its query heads)
        eps_hat = rep(1 - st.survive)[:, None].expand(h, t)
        c_e = rep(mem.centroid)[:, None].expand(h, t, d)
        r_exact = rep((ev.float() - mem.centroid[:, None]).norm(dim=-1).masked_fill(~valid, 0).amax(-1))
        r_exact = r_exact[:, None].expand(h, t)
        ret_err = (o_star - o_r).norm(dim=-1)
        online = certificate_terms(eps_hat, self.certificate_delta, c_e, rep(mem.radius)[:, None].expand(h, t), o_r)
        exact = certificate_terms(eps_hat, (alpha - eps_hat).abs(), c_e, r_exact, o_r)
        o_norm = o_star.norm(dim=-1).clamp_min(1e-12)
        mean = lambda x: x.mean(-1).tolist()  # noqa: E731  (over queries, per head)
        self.certificates.append({
            "layer": module.layer_idx, "queries": t, "events": mem.events,
            "eps_hat": mean(eps_hat), "alpha": mean(alpha), "gate": mean(gate),
            "ret_err": mean(ret_err), "comp_err": mean((o_star - o_hat).norm(dim=-1)),
            "ret_err_rel": mean(ret_err / o_norm),
            "terms": online.mean(1).tolist(), "bound": mean(online.sum(-1)), "bound_rel": mean(online.sum(-1) / o_norm),
            "comp_gain": mean(1 - (o_star - o_hat).norm(dim=-1) / ret_err.clamp_min(1e-12)),
            "bound_exact": mean(exact.sum(-1)), "holds_exact": mean((ret_err <= exact.sum(-1) + 1e-5).float()),
            "holds": mean((ret_err <= online.sum(-1)).float()),
        })  # fmt: skip


@dataclass(repr=False)
class CertifiedCorePress(CorePress, name="core_certified"):
    """The ``core`` press whose memory logs the certificate: the composed stack with its latent memory rebuilt as a
    :class:`CertifiedMemoryPress` of the same options around the same pieces; refused without memory.

    Args:
        certificate_delta, write_noise: The memory's (:class:`CertifiedMemoryPress`).
    """

    certificate_delta: float = 0.05
    write_noise: float = 0.0

    def validate(self) -> None:
        super().validate()
        m = self.memory_press
        if self.options.memory_layers is None or not isinstance(m, LatentMemoryPress | None):
            raise ValueError(
                f"{self.name} audits the memory, but this composition ({self.options.describe()}) has none"
            )
        if m is None:  # the no-op press: nothing is evicted, nothing to audit
            return
        for options, stack in self._stacks.items():  # every length band's stack: its memory becomes the audited one
            if isinstance(stack, LatentMemoryPress):
                self._stacks[options] = CertifiedMemoryPress(
                    press=stack.press, memory=stack.memory, write_rule=stack.write_rule, layers=stack.layers,
                    budget_matched=stack.budget_matched, memory_dtype=stack.memory_dtype,
                    certificate_delta=self.certificate_delta, write_noise=self.write_noise,
                )  # fmt: skip
        self._use(self.length)

    @property
    def certificates(self) -> list:
        return self.memory_press.certificates
