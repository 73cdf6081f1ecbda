"""Typed configs: a dataclass tree, YAML files that only override its defaults, and ``a.b=v`` overrides.

Example::

    cfg = load_config(EvalConfig, ["configs/eval/ruler.yaml", "methods=[snapkv,knorm]", "ratios=[0.5]"])
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf

T = TypeVar("T")


def load_config(schema: type[T], argv: list[str] | None = None) -> T:
    """Build ``schema`` from defaults, then YAML files (``*.yaml``/``--config F``), then ``a.b=v`` dotlist overrides.

    Unknown keys and wrongly typed values raise, naming the key; ``__post_init__`` validation runs on the result.
    """
    argv = list(argv or [])
    base = OmegaConf.structured(schema)
    layers = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config", "-c"):
            if i + 1 >= len(argv):
                raise ValueError("--config needs a YAML path")
            arg = argv[i + 1]
            i += 1
        if "=" in arg and not arg.endswith((".yaml", ".yml")):
            layers.append(OmegaConf.from_dotlist([arg.removeprefix("--")]))
        elif arg.endswith((".yaml", ".yml")):
            path = Path(arg)
            if not path.is_file():
                raise FileNotFoundError(f"config file not found: {path}")
            layers.append(OmegaConf.load(path))
        else:
            raise ValueError(f"cannot parse argument {arg!r}: expected a YAML file or key=value")
        i += 1
    try:
        merged = OmegaConf.merge(base, *layers)
    except Exception as e:  # omegaconf's errors name the key; re-raise as ValueError for one error type
        raise ValueError(f"invalid config for {schema.__name__}: {e}") from e
    return OmegaConf.to_object(merged)  # type: ignore[return-value]  # runs __post_init__


def to_dict(cfg: Any) -> dict:
    """Resolved config as a plain dict (for saving beside outputs and for trackers)."""
    if dataclasses.is_dataclass(cfg):
        return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
    return dict(cfg)
