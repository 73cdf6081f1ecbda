"""Head-shared selection: one score per token per layer, the same kept set in every KV head.

The CORE authors' release scores each token once per layer, shared by the layer's KV heads (GitHub
``zhutizi23-coder/CORE`` ``core/indexer.py``; notes ``../shared/research/anchors_turn3.md`` §5; our spec-v3 scorer,
``research/released/presses.py``), while core_kv's reconstruction from the paper
(``../shared/papers/002_8a6c3448532074fc.txt``; ``../shared/design/CORE.md``, our v2 indexer) scores each KV head. This
wrapper turns any per-head scorer into a head-shared one at
inference, so the choice can be measured one at a time on the same trained scorer (issue 44; ``docs/method.md``
"Which released choices carry the quality").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core_kv.presses.adakv import AdaKVPress
from core_kv.presses.base import ScorerPress, WrapperPress


@dataclass
class HeadSharedPress(WrapperPress, ScorerPress, name="head_shared"):
    """Keep the same positions in every KV head of a layer: the Top-B of the inner scorer's scores averaged over the
    KV heads.

    The average is over the inner press's :meth:`~core_kv.presses.base.ScorerPress.pooled_scores`, the scores on one
    scale across heads: CORE's scorer gives its calibrated distribution ``p`` (one per head, each summing to 1), so the
    shared score is the layer's mean attention share ``(1/Hkv) Σ_h p_h(i)``; another scorer gives its raw scores. The
    protected sinks and recent positions and the budget are the inner press's; the memory and the repair pass see the
    inner press's per-head events unchanged.

    ``build_press("head_shared", press="core_scorer", press_options={"checkpoint": ...}, compression_ratio=0.75)``.

    Args:
        press: The per-head scorer (a ``ScorerPress`` or its registered name). Head-wise budgets (AdaKV) are refused:
            one shared score gives every head the same set.
    """

    compress = ScorerPress.compress  # score (shared) -> protect -> select (per head, the same Top-B in each)

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.press, ScorerPress) or isinstance(self.press, (AdaKVPress, HeadSharedPress)):
            raise ValueError(f"head_shared wraps a per-head scorer press (name or ScorerPress, not adakv), got "
                             f"{type(self.press).__name__}")  # fmt: skip

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        lengths = kwargs["kv_lengths"]
        if bool((lengths != lengths[0]).any()):
            raise ValueError(f"head_shared: layer {module.layer_idx} holds a ragged cache ({lengths.tolist()} entries "
                             "per KV head): a shared score needs the same positions in every head")  # fmt: skip
        scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)
        pooled = self.press.pooled_scores(module, scores).float()
        return pooled.mean(dim=1, keepdim=True).expand_as(pooled).contiguous()
