"""The released recipe's tests: importing the plugin registers its presses, recipe and artifact class."""

from __future__ import annotations

import os

import research.released  # noqa: F401  (registration)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
