"""The teacher entry point on a tiny config-built GQA Llama: dataset round trip, mismatch refusal, π_U against the
model's own attention, and a 2-process run equal to the 1-process run (CORE.md stage 1)."""

from __future__ import annotations

import json
import shutil
import socket

import pytest
import torch

from core_kv.config import load_config
from core_kv.documents import make_docs
from core_kv.features import NUM_FEATURES
from core_kv.geometry import Geometry
from core_kv.models.loading import load_from_spec
from core_kv.teacher.__main__ import main
from core_kv.teacher.config import TeacherConfig, event_times
from core_kv.teacher.dataset import TeacherDataset, TeacherDatasetMismatch
from tests.helpers import locked_by_another

TINY = [
    "model.random_init=true",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=64",
    "data.source=random",
    "data.num_docs=3",
    "data.calib_docs=1",
    "data.min_len=150",
    "data.max_len=200",
    "chunk_size=64",
    "lam=1.0",
    "progress=false",
    "threads=1",
]


@pytest.fixture(scope="module")
def one_proc(tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher1")
    metrics = main([*TINY, f"out_dir={out}"])
    return out, metrics


def test_run_writes_a_complete_dataset(one_proc, capsys):
    out, metrics = one_proc
    assert {"manifest.json", "metrics.json", "geometry.safetensors", "feature_stats.safetensors", "config.yaml"} <= {
        p.name for p in out.iterdir()
    }
    for key in ("table5", "table7", "throughput"):
        assert key in metrics
    assert json.loads((out / "metrics.json").read_text())["table5"] == metrics["table5"]
    ds = TeacherDataset(out)
    cfg = load_config(TeacherConfig, [*TINY, f"out_dir={out}"])
    docs = make_docs(cfg.data, list(range(3)), None)
    n_events = sum(len(event_times(len(d.ids), d.qa_start, 64)) for d in docs)
    recs = ds.records()
    assert len(recs) == len(ds) == n_events * 2  # 2 layers
    for r in recs:
        n = r.positions.numel()
        assert r.features.shape == (2, n, NUM_FEATURES) and r.pi_u.shape == (2, n) == r.p_star.shape
        torch.testing.assert_close(r.p_star.sum(-1), torch.ones(2), atol=1e-5, rtol=0)
        assert r.budgets.tolist() == [n // 4, n // 10]
    assert ds.feature_stats().mean.shape == (2, 2, NUM_FEATURES)
    geometry = Geometry.load(ds.geometry_path, ds.manifest["fingerprint"])
    assert geometry.prototypes.shape == (2, 2, 64, 8)  # d_z = min(64, head_dim 8)


def test_utility_matches_model_attention(one_proc):
    """π_U from the hooks equals the eager model's own attention weights, averaged as the design says."""
    out, _ = one_proc
    cfg = load_config(TeacherConfig, [*TINY, "model.attn_implementation=eager"])
    model, _ = load_from_spec(cfg.model, torch.device("cpu"))
    doc = make_docs(cfg.data, [1], None)[0]  # odd index: has a question/answer tail
    with torch.no_grad():
        att = model(torch.tensor([doc.ids]), output_attentions=True).attentions  # per layer (1, H, T, T)
    rec = next(r for r in TeacherDataset(out).records() if r.doc == 1 and r.event == 0 and r.layer == 1)
    t_e = rec.positions.numel()
    nxt = torch.arange(t_e, t_e + 64)
    qa = torch.arange(doc.qa_start, len(doc.ids))
    a = att[1][0].view(2, 2, *att[1].shape[-2:])  # (Hkv, G, T, T)
    u = 0.5 * a[:, :, nxt, :t_e].mean((1, 2)) + 0.5 * a[:, :, qa, :t_e].mean((1, 2))
    torch.testing.assert_close(rec.pi_u, u / u.sum(-1, keepdim=True), atol=1e-5, rtol=1e-4)


def test_max_pooled_utility_matches_model_attention(tmp_path):
    """``utility_pool=max``: per query group (next chunk, QA tail) the max over its queries of the head-mean attention,
    mixed by the groups' weights, against the eager model's own attention; recorded in the manifest; the default
    (mean) is left out of the teacher parameters, so datasets built before the option keep theirs."""
    assert "utility_pool" not in TeacherConfig().teacher_params()
    with pytest.raises(ValueError, match="utility_pool"):
        load_config(TeacherConfig, [*TINY, "utility_pool=median"])
    out = tmp_path / "max"
    main([*TINY, f"out_dir={out}", "data.num_docs=2", "utility_pool=max", "metrics=false"])
    assert TeacherDataset(out).manifest["teacher"]["utility_pool"] == "max"
    cfg = load_config(TeacherConfig, [*TINY, "model.attn_implementation=eager"])
    model, _ = load_from_spec(cfg.model, torch.device("cpu"))
    doc = make_docs(cfg.data, [1], None)[0]
    with torch.no_grad():
        att = model(torch.tensor([doc.ids]), output_attentions=True).attentions
    rec = next(r for r in TeacherDataset(out).records() if r.doc == 1 and r.event == 0 and r.layer == 1)
    t_e = rec.positions.numel()
    a = att[1][0].view(2, 2, *att[1].shape[-2:]).mean(1)  # (Hkv, T, T), head-mean
    u = 0.5 * a[:, t_e : t_e + 64, :t_e].amax(1) + 0.5 * a[:, doc.qa_start :, :t_e].amax(1)
    torch.testing.assert_close(rec.pi_u, u / u.sum(-1, keepdim=True), atol=1e-5, rtol=1e-4)


def test_reader_refuses_mismatches(one_proc, tmp_path):
    out, _ = one_proc
    cfg = load_config(TeacherConfig, TINY)
    model, _ = load_from_spec(cfg.model, torch.device("cpu"))
    from core_kv.models.fingerprint import model_fingerprint

    fp = model_fingerprint(model)
    TeacherDataset(out, fingerprint=fp, teacher={"lam": 1.0, "steps": 8})  # matches
    with pytest.raises(TeacherDatasetMismatch, match="lam"):
        TeacherDataset(out, teacher={"lam": 0.5})
    with pytest.raises(TeacherDatasetMismatch, match="different base model"):
        TeacherDataset(out, fingerprint={**fp, "num_layers": 32, "layers": 32})
    with pytest.raises(TeacherDatasetMismatch, match="feature"):
        TeacherDataset(out, feature_version=99)
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["format"] = "core_kv.teacher/0"
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TeacherDatasetMismatch, match="format"):
        TeacherDataset(bad)
    m["format"] = json.loads((out / "manifest.json").read_text())["format"]
    m["feature_spec"]["obs_window"] = 128  # same version and names, another window (distill_gap.py --obs-window)
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TeacherDatasetMismatch, match=r"obs_window=128 \(code: 32\)"):
        TeacherDataset(bad)
    (bad / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="did not finish"):
        TeacherDataset(bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_the_same_allocations(one_proc, tmp_path):
    """Documents split across 2 real gloo ranks (the accelerate CLI with env.md §5's flags) -> the same records.

    A subprocess, not a fork of this (multi-threaded) pytest process: forked ranks can deadlock in torch's thread pool.
    """
    import os
    import subprocess
    import sys

    out1, _ = one_proc
    out2 = tmp_path / "two"
    out2.mkdir()
    shutil.copy(out1 / "geometry.safetensors", out2 / "geometry.safetensors")  # geometry is fitted once per model
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--num_cpu_threads_per_process", "1", "--main_process_port", str(_free_port()),
           "-m", "core_kv.teacher", *TINY, f"out_dir={out2}"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ds1, ds2 = TeacherDataset(out1), TeacherDataset(out2)
    assert ds2.manifest["num_processes"] == 2
    assert ds1.manifest["config_hash"] == ds2.manifest["config_hash"]
    r1, r2 = ds1.records(), ds2.records()
    assert [r.key for r in r1] == [r.key for r in r2]
    for a, b in zip(r1, r2, strict=True):
        torch.testing.assert_close(a.p_star, b.p_star, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(a.pi_u, b.pi_u, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(a.features, b.features, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(ds1.feature_stats().mean, ds2.feature_stats().mean, atol=1e-4, rtol=1e-4)


def test_hf_documents_keep_question_and_answer(tmp_path):
    """``data.source=hf`` (LongAlpaca-style rows): long contexts are cut in the middle, the question tail survives."""
    rows = [
        {"instruction": "w " * 400 + "Question: what?", "output": "an answer"},
        {"instruction": "short q", "output": "a"},
    ]
    (tmp_path / "train.json").write_text("\n".join(json.dumps(r) for r in rows))

    class Tok:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": ([1] if add_special_tokens else []) + [len(w) for w in text.split()]}

    cfg = load_config(TeacherConfig, ["data.source=hf", f"data.hf_dataset={tmp_path}", "data.max_len=100",
                                      "data.question_tokens=8"])  # fmt: skip
    long, short = make_docs(cfg.data, [0, 1], Tok())
    assert len(long.ids) == 100 and long.ids[-2:] == [2, 6]  # ends with the answer "an answer"
    assert long.qa_start == 100 - 2 - 8 and long.ids[long.qa_start + 6 : long.qa_start + 8] == [
        9,
        5,
    ]  # "Question: what?"
    assert short.ids == [1, 5, 1, 1] and short.qa_start == 1


def test_per_layer_lambda_moves_only_its_layers(one_proc, tmp_path):
    """``lam_layers={"1": 4.0}`` over a run at λ = 1: layer 0's p* is bit-identical to the run without overrides,
    layer 1's moves further from π_U (more coverage weight); the manifest records the overrides; bad maps raise."""
    out1, _ = one_proc
    out2 = tmp_path / "lam_layers"
    out2.mkdir()
    shutil.copy(out1 / "geometry.safetensors", out2 / "geometry.safetensors")
    main([*TINY, f"out_dir={out2}", "lam_layers={'1': 4.0}", "metrics=false"])
    ds1, ds2 = TeacherDataset(out1), TeacherDataset(out2)
    assert ds2.manifest["teacher"]["lam_layers"] == {"1": 4.0} and "lam_layers" not in ds1.manifest["teacher"]
    tv1, tv2 = [], []
    for a, b in zip(ds1.records(), ds2.records(), strict=True):
        assert a.key == b.key
        torch.testing.assert_close(a.pi_u, b.pi_u, atol=0, rtol=0)
        if b.layer == 0:
            torch.testing.assert_close(a.p_star, b.p_star, atol=0, rtol=0)
        else:
            tv1.append(0.5 * (a.p_star - a.pi_u).abs().sum(-1))
            tv2.append(0.5 * (b.p_star - b.pi_u).abs().sum(-1))
    assert (torch.cat(tv2) > torch.cat(tv1)).all()
    assert load_config(TeacherConfig, [*TINY, "lam_layers={'1': 4.0}"]).lam_at(1) == 4.0
    for bad in ("{'0-1': 2.0, '1': 3.0}", "{'3-1': 2.0}", "{'1': -1.0}", "{'a': 1.0}"):
        with pytest.raises(ValueError, match="lam_layers"):
            load_config(TeacherConfig, [*TINY, f"lam_layers={bad}"])


def _copy(one_proc, tmp_path):
    out, _ = one_proc
    dst = tmp_path / "finished"
    shutil.copytree(out, dst)
    return dst, (dst / "manifest.json").read_bytes()


def test_a_bad_option_on_a_finished_folder_loses_nothing(one_proc, tmp_path):
    """``model.dtype=bogus`` deleted manifest.json, then failed with ``module 'torch' has no attribute 'bogus'``."""
    from core_kv.config import ConfigError

    out, manifest = _copy(one_proc, tmp_path)
    for bad, message in [("model.dtype=bogus", r"model\.dtype must be one of"), ("lam=nan", r"lam must be a finite")]:
        with pytest.raises(ConfigError, match=message):
            main([*TINY, f"out_dir={out}", bad])
        assert (out / "manifest.json").read_bytes() == manifest


def test_a_finished_dataset_is_kept_for_its_config_and_refused_for_another(one_proc, tmp_path, capsys):
    out, manifest = _copy(one_proc, tmp_path)
    shard = next((out / "shards").iterdir())
    stamp = shard.stat().st_mtime_ns
    metrics = main([*TINY, f"out_dir={out}"])  # the same config: kept, not rebuilt
    assert "is finished for this config and base model: kept" in capsys.readouterr().out
    assert metrics == json.loads((out / "metrics.json").read_text())
    assert shard.stat().st_mtime_ns == stamp and (out / "manifest.json").read_bytes() == manifest
    with pytest.raises(ValueError, match=rf"{out} holds a finished teacher dataset of another config"):
        main([*TINY, f"out_dir={out}", "lam=0.5"])
    assert (out / "manifest.json").read_bytes() == manifest
    main([*TINY, f"out_dir={out}", "lam=0.5", "overwrite=true"])  # asked: replaced
    assert TeacherDataset(out).manifest["teacher"]["lam"] == 0.5


def test_a_dataset_written_before_an_option_existed_is_still_this_config(one_proc, tmp_path, capsys):
    """A folder whose config.yaml lacks an option that now exists at its default (and whose hash predates it) is
    the same config: kept, not refused."""
    out, manifest = _copy(one_proc, tmp_path)
    m = json.loads(manifest)
    m["config_hash"] = "0" * 16  # as hashed before the option existed
    (out / "manifest.json").write_text(json.dumps(m))
    text = (out / "config.yaml").read_text()
    assert "utility_pool: mean\n" in text
    (out / "config.yaml").write_text(text.replace("utility_pool: mean\n", ""))
    shard = next((out / "shards").iterdir())
    stamp = shard.stat().st_mtime_ns
    main([*TINY, f"out_dir={out}"])
    assert "is finished for this config and base model: kept" in capsys.readouterr().out
    assert shard.stat().st_mtime_ns == stamp


def test_a_second_teacher_run_into_a_folder_being_written_is_refused(one_proc, tmp_path):
    from core_kv.lock import LOCK_NAME, FolderLocked

    out, manifest = _copy(one_proc, tmp_path)
    with locked_by_another(out, "teacher run", "x") as pid:
        with pytest.raises(FolderLocked, match=rf"being written by another teacher run \(pid {pid}"):
            main([*TINY, f"out_dir={out}", "lam=0.5", "overwrite=true"])
        assert (out / "manifest.json").read_bytes() == manifest
    main([*TINY, f"out_dir={out}"])  # its owner is gone: the stale lock is replaced
    assert not (out / LOCK_NAME).exists()


def test_a_damaged_manifest_is_named(one_proc, tmp_path):
    out, _ = _copy(one_proc, tmp_path)
    (out / "manifest.json").write_bytes(b"\x80\x81 not json")
    with pytest.raises(ValueError, match=rf"{out / 'manifest.json'}: unreadable teacher manifest"):
        main([*TINY, f"out_dir={out}"])
    with pytest.raises(ValueError, match=rf"{out / 'manifest.json'}: unreadable teacher manifest"):
        TeacherDataset(out)
    shutil.copy(one_proc[0] / "manifest.json", out / "manifest.json")
    shard = next((out / "shards").iterdir())
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"{shard}: unreadable teacher shard"):
        TeacherDataset(out).records()


def test_a_given_geometry_of_another_model_is_refused_not_replaced(one_proc, tmp_path):
    """``geometry_path`` naming another model's geometry was refitted and saved over it."""
    out, _ = one_proc
    given = tmp_path / "other_geometry.safetensors"
    shutil.copy(out / "geometry.safetensors", given)
    before = given.read_bytes()
    with pytest.raises(
        ValueError, match=rf"geometry_path {given} cannot be used for this model .*different base model"
    ):
        main([*TINY, f"out_dir={tmp_path / 'new'}", f"geometry_path={given}", "model.seed=1"])
    assert given.read_bytes() == before


def test_an_interrupted_run_resumes_after_its_finished_documents(one_proc, tmp_path, monkeypatch, capsys):
    """Ctrl-C during the third document (issue 59): the relaunch restores the first two documents' shards and
    Recorder, runs only documents 2.., and ends with the uninterrupted run's shards (byte for byte) and metrics."""
    import hashlib

    import core_kv.teacher.run as run

    reference, ref_metrics = one_proc
    out = tmp_path / "interrupted"
    seen: list[int] = []
    stop = [True]  # the first launch stops inside document 2
    real = run._layer_hook

    def hook(cfg, doc, *args, **kwargs):
        fn = real(cfg, doc, *args, **kwargs)

        def wrapped(layer, *a, **k):
            seen.append(doc.index)
            if doc.index == 2 and layer == 1 and stop:
                stop.clear()
                raise KeyboardInterrupt
            return fn(layer, *a, **k)

        return wrapped

    monkeypatch.setattr(run, "_layer_hook", hook)
    with pytest.raises(KeyboardInterrupt):
        main([*TINY, f"out_dir={out}"])
    assert not (out / "manifest.json").exists()
    assert json.loads((out / "parts" / "rank000.progress.json").read_text())["docs"] == 2
    first = len(seen)
    metrics = main([*TINY, f"out_dir={out}"])
    assert "resuming after 2 of 3 documents" in capsys.readouterr().out
    assert set(seen[first:]) == {2}  # only the unfinished document ran again
    ref, got = TeacherDataset(reference).manifest, TeacherDataset(out).manifest
    assert got["shards"] == ref["shards"] and got["num_records"] == ref["num_records"]
    for s in ref["shards"]:
        digest = [hashlib.sha256((d / s["file"]).read_bytes()).hexdigest() for d in (reference, out)]
        assert digest[0] == digest[1], s["file"]
    for table in ("table5", "table7"):
        assert metrics[table] == ref_metrics[table]
    assert not list((out / "parts").glob("*progress*"))  # the finished run keeps no progress files
