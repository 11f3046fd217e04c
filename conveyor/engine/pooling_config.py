"""A checkpoint's pooling, read the way sentence-transformers reads it: ``modules.json``
lists the modules; the ``Pooling`` module's folder has a ``config.json`` with one
``pooling_mode_*`` flag set; a ``Normalize`` module after it means unit-norm vectors.

Without those files a decoder pools its last token and normalises (what its embedding
checkpoints do and vLLM assumes). A pooling mode the engine cannot compute exactly (max,
weighted mean, mean of square roots) is refused at load with the reason."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from conveyor.engine.pooling_params import PoolingParams

# sentence-transformers' flags -> our modes; the others cannot be served exactly.
_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_POOLING_TYPES = ("sentence_transformers.models.Pooling", "sentence_transformers.models.pooling.Pooling")
_NORMALIZE_TYPES = ("sentence_transformers.models.Normalize", "sentence_transformers.models.normalize.Normalize")


@dataclass(frozen=True)
class PoolingConfig:
    """The model's own pooling (``source`` says where it was read)."""

    pooling: str = "last"
    normalize: bool = True
    source: str = "default (no sentence-transformers modules.json)"

    def resolve(self, params: PoolingParams, hidden_size: int) -> ResolvedPooling:
        """A request's pooling: its own fields over the model's; ``ValueError`` on bad ``dimensions``."""
        if params.dimensions is not None and params.dimensions > hidden_size:
            raise ValueError(
                f"dimensions must be at most the model's embedding size {hidden_size}, got {params.dimensions}"
            )
        return ResolvedPooling(
            pooling=params.pooling or self.pooling,
            normalize=self.normalize if params.normalize is None else params.normalize,
            dimensions=params.dimensions,
        )


@dataclass(frozen=True)
class ResolvedPooling:
    pooling: str
    normalize: bool
    dimensions: int | None

    @property
    def needs_every_row(self) -> bool:
        """Whether every prompt token's hidden state is read (so none may come from the prefix cache)."""
        return self.pooling != "last"


def read_pooling_config(model_dir: Path, default: PoolingConfig | None = None) -> PoolingConfig:
    """The pooling ``model_dir``'s sentence-transformers files give; ``default`` (the
    decoders' last-token pooling unless given) without them."""
    default = default or PoolingConfig()
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return default
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{modules_file} is not readable JSON: {exc}") from None
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file} must be a list of modules")
    types = [m.get("type") for m in modules if isinstance(m, dict)]
    pooling_dirs = [m.get("path", "") for m in modules if isinstance(m, dict) and m.get("type") in _POOLING_TYPES]
    if not pooling_dirs:
        return replace(default, source=f"{modules_file} (no Pooling module: default)")
    normalize = any(t in _NORMALIZE_TYPES for t in types)
    config_file = model_dir / pooling_dirs[0] / "config.json"
    try:
        flags = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"the Pooling module's {config_file} is not readable JSON: {exc}") from None
    unsupported = [f for f in _UNSUPPORTED if flags.get(f)]
    if unsupported:
        raise ValueError(f"{config_file} asks for {', '.join(unsupported)}; the engine pools last, mean or cls only")
    if flags.get("include_prompt") is False:
        raise ValueError(f"{config_file} sets include_prompt false (Instructor models); the engine cannot serve it")
    modes = [mode for flag, mode in _MODES.items() if flags.get(flag)]
    if len(modes) != 1:
        raise ValueError(f"{config_file} must set exactly one of {', '.join(_MODES)}; it sets {len(modes)}")
    return PoolingConfig(pooling=modes[0], normalize=normalize, source=str(config_file))
