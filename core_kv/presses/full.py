"""No compression: the reference every method is compared against."""

from __future__ import annotations

from dataclasses import dataclass

from core_kv.presses.base import BasePress


@dataclass
class FullPress(BasePress, name="full"):
    """Keeps the whole cache (``compression_ratio`` must stay 0; a budget is ignored)."""

    def validate(self) -> None:
        super().validate()
        if self.compression_ratio != 0.0 or self.budget is not None:
            raise ValueError("the full press keeps everything: leave compression_ratio=0 and budget=None")
