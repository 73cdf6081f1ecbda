"""``paper_protocol``: the CORE paper's evaluation protocol around any press (CORE and the baselines alike).

Source: the CORE authors' release, GitHub ``zhutizi23-coder/CORE`` ``core/paper_protocol.py`` (``retained_budget``,
``PaperScorerPress``, ``PaperPrefillDecodingPress``, ``wrap_paper_baseline``) and the ``DecodingPress`` of its kvpress
copy, read for the specification. The protocol changes *when* and *to what size* a press evicts, never how it
scores::

    prefill    the context is compressed once to B = floor(N (1 − r)) per KV head; the first ``sinks`` (4) positions
               are kept and counted inside B
    decoding   every forward after the prefill (the question's, then each generated token's) is one step of the
               layer; after ``interval`` (128) steps, or a forward of at least B tokens, the layer is compressed back
               to B (the prefill budget, not a share of the tokens seen so far) by the wrapped press, which scores with
               the hidden states of the steps since its last event (at most ``buffer`` forwards, each with its own
               positions' RoPE tables) as its queries; the step count and the buffer restart

The question is fed on top of the compressed context, as in the harness's default protocol (kvpress's pipeline), and
the pipeline re-prefills the context for every question (decode-time events change the shared context). ``eval.py``
wraps every compressed method of a run in this press with ``protocol: core_paper`` (``core_kv.eval.runner``); the
results folders and tables name such a cell ``<method>@core_paper``.

Differences from the release, none of which changes a 2k-token cell:

- B is at least 1 (the release: at least ``min(sinks, N)``); they differ only when ``floor(N (1 − r)) < 4``.
- The release refuses a press whose selection is not kvpress's ``ScorerPress.compress`` (merging, head-wise budgets).
  Here the sinks are forced through every press of the stack's :meth:`~core_kv.presses.base.BasePress.protected`
  (a press's own protected recent window stays), which every registered press honours, head-wise budgets
  (AdaKV: an average of B per head) included; ``tests/test_paper_protocol.py`` checks the sinks and the budget for
  each of them. A method that compresses a prefix only once (TwinKV, paper §4) refuses the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from core_kv.presses.base import BasePress, Kept, WrapperPress

CORE_PAPER = "core_paper"
"""The protocol's name in eval configs (``protocol: core_paper``) and in results folders (``<method>@core_paper``)."""


@dataclass(repr=False)
class PaperProtocolPress(WrapperPress, name="paper_protocol"):
    """The CORE paper's protocol around ``press``: ``build_press("paper_protocol", press="snapkv",
    compression_ratio=0.75)``.

    Args:
        press: The wrapped press (an instance or a registered name).
        sinks: First positions kept at every event, inside the budget (the paper: 4).
        interval: Decoding forwards between two decode-time events (the paper: 128).
        buffer: Forwards whose hidden states the wrapped press scores with at a decode-time event (the paper: 128).
        decoding: Always true, handed to the wrapped press (which holds it, as the budget): the protocol compresses
            again while decoding (``decoding=False`` is refused; a prefill-only cell is the wrapped press alone).
    """

    sinks: int = 4
    interval: int = 128
    buffer: int = 128

    def validate(self) -> None:
        for name, low in (("sinks", 0), ("interval", 1), ("buffer", 1)):
            v = getattr(self, name)
            if v < low:
                raise ValueError(f"{self.name}: {name} must be an integer >= {low}, got {v}")
        if self.decoding is False:  # this press's hooks decide decode-time events (decode_event)
            raise ValueError(f"{self.name}: decoding={self.decoding!r}, but the protocol compresses again while "
                             "decoding (every `interval` forwards); for a prefill-only cell use the wrapped press alone")  # fmt: skip
        self.decoding = True  # given here: handed to the wrapped press, which holds it
        super().validate()
        press = self.press
        while isinstance(press, BasePress):  # every press of the stack: decode-time bookkeeping, the sinks protected
            press.decoding = True  # a wrapper writes it through to the press that holds it
            if not isinstance(press, WrapperPress):  # a method that compresses a prefix once refuses decoding
                try:
                    press.validate()
                except ValueError as e:
                    raise ValueError(f"{self.name}: {e} (the protocol compresses again while decoding)") from None
            if isinstance(press.protected_sinks, int):
                press.protected_sinks = max(press.protected_sinks, self.sinks)
            press = press.press if isinstance(press, WrapperPress) else None

    def after_forward(self, module: nn.Module, hidden_states: torch.Tensor, cache, kwargs: dict) -> None:
        super().after_forward(module, hidden_states, cache, kwargs)
        st = self.layer_state[module.layer_idx]
        if self._mode == "prefill" or st["empty_before"]:  # a prefill forward: the budget every later event holds
            st["paper_budget"] = self.press.layer_target(module, st["seen"])
            st["paper_steps"], st["paper_buffer"], st["paper_last"] = 0, [], 0
            return
        cos, sin = kwargs["position_embeddings"]
        pid = kwargs.get("position_ids")
        st["paper_buffer"] = [*st["paper_buffer"], (hidden_states.detach(), cos, sin, pid)][-self.buffer :]
        st["paper_steps"] += 1
        st["paper_last"] = hidden_states.shape[1]

    def decode_event(self, module: nn.Module, seen: int, lengths: torch.Tensor) -> int | None:
        st = self.layer_state[module.layer_idx]
        budget = st["paper_budget"]
        if st["paper_steps"] < self.interval and st["paper_last"] < budget:
            return None
        st["paper_event"] = True
        return budget

    def compress(self, module, hidden_states, keys, values, attentions, kwargs, n_kept, lengths=None) -> Kept:
        st = self.layer_state[module.layer_idx]
        if st.pop("paper_event", False):  # a decode-time event: the buffered forwards are the queries
            buf = st["paper_buffer"]
            hidden_states = torch.cat([b[0] for b in buf], 1)
            kwargs = {**kwargs, "position_embeddings": (torch.cat([b[1] for b in buf], -2),
                                                        torch.cat([b[2] for b in buf], -2))}  # fmt: skip
            if all(b[3] is not None for b in buf):
                kwargs["position_ids"] = torch.cat([b[3] for b in buf], 1)
            st["paper_buffer"], st["paper_steps"] = [], 0
        return self.press.compress(module, hidden_states, keys, values, attentions, kwargs, n_kept, lengths=lengths)


__all__ = ["CORE_PAPER", "PaperProtocolPress"]
