"""A checkpoint's pooling, read the way sentence-transformers reads it: ``modules.json``
lists the modules; the ``Pooling`` module's folder has a ``config.json`` naming the mode
(``pooling_mode``, sentence-transformers 6.x; one ``pooling_mode_*`` flag set, earlier
releases); a ``Normalize`` module after it means unit-norm vectors.

Module types are known by their class in either layout (``sentence_transformers.models.Pooling``
before 6.x, ``sentence_transformers.sentence_transformer.modules.pooling.Pooling`` and
``sentence_transformers.base.modules.normalize.Normalize`` from 6.x on). Without those files a
decoder pools its last token and normalises (what its embedding checkpoints do and vLLM
assumes). What the engine cannot compute exactly is refused at load with the reason: a module
it does not serve (``Dense``...), a pooling mode other than last, mean or cls, a modules.json
it cannot read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from conveyor.engine.pooling.pooling_params import PoolingParams

# sentence-transformers' pooling modes (6.x names, and the older flags) -> ours; the others
# (max, mean_sqrt_len_tokens, weightedmean) cannot be served exactly.
_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_FLAGS = {
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
# The module classes the engine serves (the Transformer is the model itself).
_SERVED = ("Transformer", "Pooling", "Normalize")
_PACKAGE = "sentence_transformers."


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
    decoders' last-token pooling unless given) without them; ``ValueError`` naming what the
    engine cannot serve."""
    default = default or PoolingConfig()
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return default
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{modules_file} is not readable JSON: {exc}") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{modules_file} must be a list of modules")
    classes = [_module_class(modules_file, m) for m in modules]
    if classes.count("Pooling") != 1 or classes[0] != "Transformer":
        raise ValueError(f"{modules_file} lists {classes}; the engine serves a Transformer, one Pooling, a Normalize")
    pooling_dir = modules[classes.index("Pooling")].get("path", "")
    config_file = model_dir / str(pooling_dir) / "config.json"
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"the Pooling module's {config_file} is not readable JSON: {exc}") from None
    if settings.get("include_prompt") is False:
        raise ValueError(f"{config_file} sets include_prompt false (Instructor models); the engine cannot serve it")
    return PoolingConfig(
        pooling=_pooling_mode(config_file, settings), normalize="Normalize" in classes, source=str(config_file)
    )


def _module_class(modules_file: Path, module: dict) -> str:
    """A module's class name, in either layout; ``ValueError`` naming a type the engine does not serve."""
    kind = str(module.get("type", ""))
    name = kind.rsplit(".", 1)[-1]
    if not kind.startswith(_PACKAGE) or name not in _SERVED:
        raise ValueError(f"{modules_file} has a {kind!r} module; the engine serves {', '.join(_SERVED)} only")
    return name


def _pooling_mode(config_file: Path, settings: dict) -> str:
    """Our mode for the Pooling config: its ``pooling_mode`` (6.x) or its one flag set (earlier)."""
    if "pooling_mode" in settings:
        mode = settings["pooling_mode"]
        chosen = [(m, f"pooling_mode {m!r}") for m in (mode if isinstance(mode, list) else [mode])]
    else:
        chosen = [(name, flag) for flag, name in _FLAGS.items() if settings.get(flag)]
    if len(chosen) != 1:
        raise ValueError(
            f"{config_file} must set exactly one of pooling_mode, {', '.join(_FLAGS)}; it sets {[c[1] for c in chosen]}"
        )
    mode, label = chosen[0]
    if mode not in _MODES:
        raise ValueError(f"{config_file} asks for {label}; the engine pools last, mean or cls only")
    return _MODES[mode]
