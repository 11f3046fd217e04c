"""Multimodal Gemma checkpoints (``Gemma3ForConditionalGeneration``,
``Gemma4ForConditionalGeneration``) served by their language model: the ``text_config`` as
the text model's config, the language model's tensors under the text model's names, the
vision and audio towers' tensors skipped. Images are not served (a chat line with an image
part is refused by ``conveyor.worker.batchio``)."""

from __future__ import annotations

# A checkpoint's language-model prefix -> the text model's. transformers 5.x saves
# ``model.language_model.``; Gemma 3's released files (transformers 4.50) say ``language_model.model.``.
_LANGUAGE_MODEL_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
# The towers and their projections into the text model's embeddings, in either spelling.
_TOWERS = ("vision_tower.", "audio_tower.", "multi_modal_projector.", "embed_vision.", "embed_audio.")
_TOWER_PREFIXES = _TOWERS + tuple("model." + t for t in _TOWERS)


def gemma_language_model_config(cfg: dict, architecture: str) -> dict:
    """A multimodal Gemma config as its text model's (run by ``architecture``), completed with
    transformers' defaults: the released configs name only what differs from them (Gemma 3 4B's ``text_config`` has
    six keys), and transformers' config class also rewrites the 4.x spelling the way the text
    model reads it."""
    from transformers import AutoConfig

    text = dict(cfg.get("text_config") or {})
    for key in ("eos_token_id", "pad_token_id", "dtype", "torch_dtype"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    text_type = str(cfg["model_type"]) + "_text"
    text.pop("model_type", None)
    out = AutoConfig.for_model(text_type, **text).to_dict()
    out["model_type"] = text_type
    out["architectures"] = [architecture]
    # (the wrapper decides: Gemma ties its embeddings, and the wrapper's default is to tie)
    out["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
    return out


def language_model_name(name: str) -> str | None:
    """The text model's name for a (possibly multimodal) checkpoint's tensor; None for a tower's."""
    if name.startswith(_TOWER_PREFIXES):
        return None
    for prefix, text_prefix in _LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return text_prefix + name[len(prefix) :]
    return name
