"""On-disk teacher dataset: safetensors shards, a versioned manifest, and a reader that refuses mismatches.

Layout of ``out_dir``::

    manifest.json                 format, feature spec, teacher parameters, base-model fingerprint, config hash,
                                  budgets (ratios), shard list; written last, atomically (its presence = complete)
    config.yaml                   the resolved run config
    geometry.safetensors          stage-0 geometry (:class:`~core_kv.geometry.Geometry`)
    feature_stats.safetensors     standardisation statistics (:class:`~core_kv.features.FeatureStats`)
    metrics.json                  Table 5, Table 7, throughput
    shards/rank{r}-{k}.safetensors

A shard holds whole records (one record = one (document, event, layer)) concatenated along candidates:

    records   (R, 6) int64   doc, event, layer, num_candidates N, offset, length (= N)
    budgets   (R, n_ratios) int64   B per configured compression ratio
    positions (ΣN,) int32    absolute candidate positions
    features  (ΣN, Hkv, 14)  float16/float32, un-standardised
    pi_u      (ΣN, Hkv)      float32 query utility π_U (the λ = 0 teacher)
    p_star    (ΣN, Hkv)      float32 teacher allocation p* at the configured λ

Every shard is written to a temporary file and renamed, so a crash leaves no half shard.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from core_kv.features import FEATURE_SPEC_VERSION, FEATURE_SPECS, spec_differences
from core_kv.files import atomic_write, read_json
from core_kv.models.fingerprint import FingerprintMismatch, check_fingerprint

FORMAT = "core_kv.teacher/1"
MANIFEST = "manifest.json"


class TeacherDatasetMismatch(ValueError):
    """The dataset on disk was written under different settings than the reader expects."""


def config_hash(cfg: dict) -> str:
    """sha256 (16 hex) of a JSON-able dict, keys sorted."""
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class TeacherRecord:
    """One (document, event, layer): every KV head's candidates, features and targets."""

    doc: int
    event: int
    layer: int
    positions: torch.Tensor  # (N,) int
    features: torch.Tensor  # (Hkv, N, 14)
    pi_u: torch.Tensor  # (Hkv, N)
    p_star: torch.Tensor  # (Hkv, N)
    budgets: torch.Tensor  # (n_ratios,) tokens kept per head

    @property
    def key(self) -> tuple[int, int, int]:
        return self.doc, self.event, self.layer


class ShardWriter:
    """Buffers records and writes ``shards/rank{rank}-{k}.safetensors`` every ``records_per_shard`` records and at
    each :meth:`flush` (the teacher run flushes after every document, its resume point)."""

    def __init__(self, out_dir: str | Path, rank: int = 0, records_per_shard: int = 256, feature_dtype=torch.float16):
        self.dir = Path(out_dir) / "shards"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.per_shard, self.dtype = rank, records_per_shard, feature_dtype
        self.buffer: list[TeacherRecord] = []
        self.shards: list[dict] = []

    def add(self, record: TeacherRecord) -> None:
        self.buffer.append(record)
        if len(self.buffer) >= self.per_shard:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        recs, offset = [], 0
        for r in self.buffer:
            n = r.positions.numel()
            recs.append([r.doc, r.event, r.layer, n, offset, n])
            offset += n
        tensors = {
            "records": torch.tensor(recs, dtype=torch.int64),
            "budgets": torch.stack([r.budgets.to(torch.int64) for r in self.buffer]),
            "positions": torch.cat([r.positions.to(torch.int32) for r in self.buffer]),
            "features": torch.cat([r.features.transpose(0, 1).to(self.dtype) for r in self.buffer]).contiguous(),
            "pi_u": torch.cat([r.pi_u.T.float() for r in self.buffer]).contiguous(),
            "p_star": torch.cat([r.p_star.T.float() for r in self.buffer]).contiguous(),
        }
        name = f"rank{self.rank:03d}-{len(self.shards):05d}.safetensors"
        atomic_write(self.dir / name, lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT}))
        self.shards.append(
            {"file": f"shards/{name}", "records": len(recs), "candidates": offset, "docs": sorted({r[0] for r in recs})}
        )
        self.buffer = []

    def close(self) -> list[dict]:
        self.flush()
        return self.shards


def _read_shard(path: Path) -> Iterator[TeacherRecord]:
    try:
        t = load_file(str(path))
    except Exception as e:  # safetensors' errors (a truncated shard) name no path
        raise ValueError(f"{path}: unreadable teacher shard ({type(e).__name__}: {e}); regenerate the dataset") from e
    for (doc, event, layer, _n, off, length), budgets in zip(t["records"].tolist(), t["budgets"], strict=True):
        sl = slice(off, off + length)
        yield TeacherRecord(
            doc, event, layer, t["positions"][sl].long(), t["features"][sl].transpose(0, 1).float(),
            t["pi_u"][sl].T.contiguous(), t["p_star"][sl].T.contiguous(), budgets,
        )  # fmt: skip


class TeacherDataset:
    """Reader of a finished teacher run; refuses data made under other settings, with the reason.

    Args:
        path: The run's ``out_dir``.
        fingerprint: The base model's :func:`~core_kv.models.fingerprint.model_fingerprint`, if it must match.
        teacher: Teacher parameters that must match (any subset of ``manifest["teacher"]``, e.g. ``{"lam": 1.0}``).
        feature_version: Feature spec version the reader needs (the config's ``features``; default: the default spec).
    """

    def __init__(
        self,
        path: str | Path,
        fingerprint: dict | None = None,
        teacher: dict | None = None,
        feature_version: int = FEATURE_SPEC_VERSION,
    ):
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise FileNotFoundError(f"{mpath} not found: the teacher run is missing or did not finish")
        self.manifest = read_json(mpath, "teacher manifest")
        m = self.manifest
        if not isinstance(m, dict) or not {"format", "feature_spec", "teacher", "fingerprint", "shards"} <= set(m):
            raise TeacherDatasetMismatch(f"{mpath}: not a complete teacher manifest; regenerate the dataset")
        hint = "regenerate it with `python -m core_kv.teacher --config ...`"
        if m.get("format") != FORMAT:
            raise TeacherDatasetMismatch(f"{self.path}: format {m.get('format')!r}, this code reads {FORMAT!r}; {hint}")
        fs = m["feature_spec"]
        if fs["version"] != feature_version or fs["names"] != list(FEATURE_SPECS.get(feature_version, ())):
            raise TeacherDatasetMismatch(
                f"{self.path}: features are spec v{fs['version']} {fs['names'][:3]}..., this code computes "
                f"v{feature_version}; {hint}"
            )
        differ = spec_differences(fs)
        if differ:  # same version, other constants (e.g. a diagnostic's observation window)
            raise TeacherDatasetMismatch(f"{self.path}: feature spec v{feature_version} recorded with {differ}; {hint}")
        if fingerprint is not None:
            try:
                check_fingerprint(m["fingerprint"], fingerprint, f"teacher dataset {self.path}")
            except FingerprintMismatch as e:
                raise TeacherDatasetMismatch(str(e)) from e
        for k, v in (teacher or {}).items():
            if k not in m["teacher"]:
                raise TeacherDatasetMismatch(f"{self.path}: teacher parameter {k!r} not recorded")
            if m["teacher"][k] != v:
                raise TeacherDatasetMismatch(
                    f"{self.path}: teacher {k}={m['teacher'][k]!r}, expected {v!r}; {hint} (or point to the right run)"
                )
        for s in m["shards"]:
            if not (self.path / s["file"]).is_file():
                raise FileNotFoundError(f"{self.path}: shard {s['file']} listed in the manifest is missing")

    def __len__(self) -> int:
        return sum(s["records"] for s in self.manifest["shards"])

    @property
    def ratios(self) -> list[float]:
        return list(self.manifest["teacher"]["ratios"])

    def __iter__(self) -> Iterator[TeacherRecord]:
        for s in self.manifest["shards"]:
            yield from _read_shard(self.path / s["file"])

    def records(self) -> list[TeacherRecord]:
        """All records sorted by (doc, event, layer), whatever the process split that wrote them."""
        return sorted(self, key=lambda r: r.key)

    @property
    def geometry_path(self) -> Path:
        """The stage-0 geometry file (``Geometry.load(ds.geometry_path, ds.manifest["fingerprint"])`` reads it)."""
        return self.path / self.manifest["geometry"]

    def feature_stats(self):
        from core_kv.features import FeatureStats

        return FeatureStats.load(self.path / self.manifest["feature_stats"])
