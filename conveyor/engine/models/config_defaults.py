"""A published ``config.json`` completed the way transformers completes it.

Publishers leave out what equals their transformers version's default (Qwen3.5-MoE has no
``intermediate_size`` at all; Gemma 3's ``text_config`` names six keys). A key left out takes
the value transformers' own config class gives it, read from that class at load time, so no
default is copied into the engine. The published keys win: the readers in ``model_config``
apply transformers' rules to them (the 4.x and 5.x spellings included)."""

from __future__ import annotations

import copy
import logging

logger = logging.getLogger(__name__)
# transformers 4.x's RoPE keys; 5.x writes ``rope_parameters`` instead.
_ROPE_4X = ("rope_theta", "rope_scaling", "rope_local_base_freq")


def with_transformers_defaults(cfg: dict) -> dict:
    """``cfg`` with every key it lacks filled in from transformers' config class for its
    ``model_type``. Unchanged when transformers has no such class or refuses the config: the
    readers' own checks then name what they cannot serve."""
    from transformers import AutoConfig

    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        return cfg
    kwargs = copy.deepcopy({k: v for k, v in cfg.items() if k != "model_type"})  # (it edits dicts in place)
    try:
        resolved = AutoConfig.for_model(model_type, **kwargs).to_dict()
    except Exception as exc:  # (its validators raise their own error types too)
        logger.debug("transformers' %s config refused %s: %s", model_type, sorted(cfg), exc)
        return cfg
    resolved.pop("model_type", None)
    if any(key in cfg for key in _ROPE_4X):  # (RoPE stays in the publisher's spelling, read as it is)
        resolved.pop("rope_parameters", None)
    return {**resolved, **cfg}
