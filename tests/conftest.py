"""Shared fixtures: tiny models built from config (no downloads), the offline environment, a tiny CORE artifact and a
toy evaluation benchmark. Shared helpers (no fixtures) are in ``tests/helpers.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from core_kv.eval.benchmarks import write_samples
from tests.helpers import CORE_ARTIFACTS, eval_samples, fit_tiny_artifact, tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def qwen3():
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory, llama):
    """``(core, path)``: a CORE artifact fitted to ``llama`` (untrained indexer, temperature 1.5), one per module."""
    core = fit_tiny_artifact(llama)
    core.indexer.temperature.fill_(1.5)
    path = tmp_path_factory.mktemp("core") / "final"
    core.save_pretrained(path)
    return core, path


@pytest.fixture(scope="module")
def contract_artifacts(tmp_path_factory):
    """The folder :func:`tests.helpers.core_artifact` fits its per-family artifacts into, for one module."""
    CORE_ARTIFACTS["dir"] = tmp_path_factory.mktemp("core_artifacts")
    yield
    CORE_ARTIFACTS.clear()


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory) -> Path:
    """A toy JSONL benchmark (:func:`tests.helpers.eval_samples`) for ``eval.py`` runs."""
    return write_samples(tmp_path_factory.mktemp("data") / "toy.jsonl", eval_samples())
