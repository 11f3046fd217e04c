"""A cross-encoder's classification head over the encoder's first (CLS / ``<s>``) hidden state,
as transformers computes it: ``BertForSequenceClassification``'s pooler (dense, tanh) then its
``classifier``; ``XLMRobertaForSequenceClassification``'s ``classifier.dense``, tanh, then
``classifier.out_proj``. Dropout is inactive at inference. The output is the raw logits;
the activation (``conveyor.engine.scoring``) comes after."""

from __future__ import annotations

import torch
from torch import nn

from conveyor.engine.distributed.sharding import WeightSlot
from conveyor.engine.models.model_config import ModelSpec


class _Dense(nn.Module):
    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class ClassifierHead(nn.Module):
    """dense + tanh + projection to ``num_labels`` over a first-token hidden state."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = spec.hidden_size
        self.dense = _Dense(hidden, hidden, dtype, device)
        self.out = _Dense(spec.num_labels, hidden, dtype, device)
        # Where transformers keeps the two layers in each family's checkpoint.
        if spec.model_type == "bert":
            self.names = ("bert.pooler.dense", "classifier")
        else:
            self.names = ("classifier.dense", "classifier.out_proj")

    @torch.inference_mode()
    def forward(self, first_token: torch.Tensor) -> torch.Tensor:
        x = first_token.to(self.dense.weight.dtype)
        return self.out(torch.tanh(self.dense(x)))

    def weight_slots(self) -> dict[str, WeightSlot]:
        slots: dict[str, WeightSlot] = {}
        for name, layer in zip(self.names, (self.dense, self.out), strict=True):
            for part in ("weight", "bias"):
                tensor = getattr(layer, part)
                slots[f"{name}.{part}"] = (tensor, 0, tensor.shape[0])
        return slots
