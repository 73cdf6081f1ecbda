"""TwinKV repair pass: swap evicted orphans for retained redundant donors in any press's selection.

"TwinKV: A Composable Repair Pass for KV Cache Eviction via Pairwise Key Redundancy"
(``../shared/papers/001_e5fc3a72c13765dd.txt`` §3.2–3.4). Given a wrapped press's retained set ``S0`` per head,

    b_i(S0) = max_{j ∈ S0, |i - j| > w, j ≠ i} cos(k_i, k_j)      (-1 if no such j)

orphans are evicted ``i`` with ``b_i < τ`` (ascending ``b``), donors are retained unprotected ``j`` with
``b_j >= τ`` (descending ``b``), and the ``m = min(|orphans|, |donors|)`` most severe pairs are swapped, so
``|S1| = |S0|`` exactly and the wrapped press's budget (including per-head budgets) is untouched.

``b`` is computed only against the retained set, blockwise: ``O(n·K·d)`` time and ``O(block·K)`` workspace per
head, the cheaper form the paper (§3.5) leaves to future work; :func:`naive_best_twin` is the full-matrix reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core_kv.presses.base import BasePress, Kept, WrapperPress


def best_twin(
    keys: torch.Tensor, retained: torch.Tensor, local_window: int = 32, block_size: int = 512
) -> torch.Tensor:
    """``b_i(S0)`` for every position of one head: ``keys`` ``(n, D)``, ``retained`` sorted indices ``(K,)``.

    Similarities are taken against the ``K`` retained keys only, ``block_size`` positions at a time. Returns
    ``(n,)`` FP32, ``-1`` where no retained key lies outside the local window.
    """
    khat = F.normalize(keys.float(), dim=-1)  # (n, D)
    n = khat.shape[0]
    kept = khat[retained]  # (K, D)
    out = torch.full((n,), -1.0, device=keys.device)
    if retained.numel() == 0:
        return out
    for start in range(0, n, block_size):
        q = khat[start : start + block_size]  # (C, D)
        pos = torch.arange(start, start + q.shape[0], device=keys.device)
        far = (pos[:, None] - retained[None, :]).abs() > local_window  # (C, K); also excludes j == i
        sim = (q @ kept.T).masked_fill(~far, -1.0)  # (C, K)
        out[start : start + q.shape[0]] = sim.max(dim=-1).values.clamp_min(-1.0)
    return out


def naive_best_twin(keys: torch.Tensor, retained: torch.Tensor, local_window: int = 32) -> torch.Tensor:
    """Reference for :func:`best_twin` from the full ``n × n`` cosine matrix, as the paper implements it."""
    khat = F.normalize(keys.float(), dim=-1)
    n = khat.shape[0]
    sim = khat @ khat.T  # (n, n)
    pos = torch.arange(n, device=keys.device)
    allowed = ((pos[:, None] - pos[None, :]).abs() > local_window) & torch.isin(pos, retained)[None, :]
    return sim.masked_fill(~allowed, float("-inf")).max(dim=-1).values.clamp_min(-1.0)


def repair(
    keys: torch.Tensor,
    retained: torch.Tensor,
    threshold: float = 0.85,
    local_window: int = 32,
    sinks: int = 4,
    recent: int = 64,
    block_size: int = 512,
) -> torch.Tensor:
    """Repair one head's retained set (paper §3.4). ``keys`` ``(n, D)``; ``retained`` indices; returns sorted
    indices of the same size. Donors exclude the first ``sinks`` and last ``recent`` positions."""
    n = keys.shape[0]
    retained = retained.sort().values
    b = best_twin(keys, retained, local_window, block_size)  # (n,)
    pos = torch.arange(n, device=keys.device)
    in_s0 = torch.zeros(n, dtype=torch.bool, device=keys.device)
    in_s0[retained] = True
    protected = (pos < sinks) | (pos >= n - recent)
    orphans = torch.nonzero(~in_s0 & (b < threshold)).flatten()
    donors = torch.nonzero(in_s0 & ~protected & (b >= threshold)).flatten()
    m = min(orphans.numel(), donors.numel())
    if m == 0:
        return retained
    # stable sorts over ascending positions: equal severities resolve to the earlier position
    orphans = orphans[b[orphans].sort(stable=True).indices[:m]]
    donors = donors[b[donors].sort(descending=True, stable=True).indices[:m]]
    in_s0[donors] = False
    in_s0[orphans] = True
    return torch.nonzero(in_s0).flatten()


@dataclass
class TwinRepairPress(WrapperPress, name="twin_repair"):
    """The TwinKV repair pass (``../shared/papers/001_e5fc3a72c13765dd.txt`` §3.2–3.4) around any press.

    ``press`` is a registered name (built with this wrapper's ``compression_ratio``/``budget``/``decoding`` and
    ``press_options``) or an instance (its own budget is used; the wrapper's must be unset or equal). The wrapped
    press selects, then every head's retained set is repaired; per-head budgets (ragged selections) are kept, and a
    wrapper outside this one (CORE's latent memory) sees the repaired set in :meth:`~BasePress.evicted`.

    Defaults are the paper's Qwen3-4B setting ``τ = 0.85``, ``w = 32``, 4 sinks and 64 recent positions protected
    from donation; the paper's Llama-3.2-1B setting is ``threshold=0.90`` (§4.1, §4.4).

    ``protected_sinks``/``protected_recent`` protect positions from being donated, inside the event's (average)
    budget ``n_kept`` (``BasePress.protected``); they are not forwarded to the wrapped press, which keeps its own
    protection (its selection is audited as configured). The paper's baselines all protect 4 sinks and 64 recent
    positions (§3.2): reproduce that with ``press_options={"protected_sinks": 4, "protected_recent": 64}``.

    Deviations: ``b`` is computed against the retained set only (``O(n·K·d)``; identical values to the paper's
    full-matrix form, checked against :func:`naive_best_twin`). Like the paper, ``b`` is computed once from ``S0``
    and not updated between swaps.

    Args:
        press: the wrapped press, a registered name or an instance.
        press_options: extra options for a press given by name.
        threshold: τ, cosine threshold for a surviving twin.
        local_window: w, twins must satisfy ``|i - j| > local_window``.
        block_size: positions per similarity block.
    """

    protected_sinks: int = 4
    protected_recent: int = 64
    threshold: float = 0.85
    local_window: int = 32
    block_size: int = 512

    def validate(self) -> None:
        super().validate()
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be a cosine in [-1, 1], got {self.threshold!r}")
        if isinstance(self.local_window, bool) or not isinstance(self.local_window, int) or self.local_window < 0:
            raise ValueError(f"local_window must be a non-negative int, got {self.local_window!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")

    def protected(self, n_kept: int) -> tuple[int, int]:
        return BasePress.protected(self, n_kept)  # donors: this pass's own protection, not the wrapped press's

    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
        n_kept: int,
        lengths: torch.Tensor | None = None,
    ) -> Kept:
        s0 = self.press.compress(module, hidden_states, keys, values, attentions, kwargs, n_kept, lengths=lengths)
        b, h, n, _ = keys.shape
        lens = [n] * h if lengths is None else [int(x) for x in lengths]
        sinks, recent = self.protected(n_kept)
        if isinstance(s0, torch.Tensor):
            out = torch.empty_like(s0)
            for i in range(b):
                for j in range(h):
                    out[i, j] = self._repair_head(keys[i, j, : lens[j]], s0[i, j], sinks, recent)
            return out
        return [self._repair_head(keys[0, j, : lens[j]], s0[j], sinks, recent) for j in range(h)]

    def _repair_head(self, keys: torch.Tensor, retained: torch.Tensor, sinks: int, recent: int) -> torch.Tensor:
        return repair(keys, retained, self.threshold, self.local_window, sinks, recent, self.block_size)
