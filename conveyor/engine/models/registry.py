"""Which forward pass runs which architecture: the checkpoint's ``architectures`` entry (read
into ``ModelSpec.architecture``, checked against ``SUPPORTED_ARCHITECTURES``) picks the class."""

from __future__ import annotations

from conveyor.engine.models.bert import BertEncoder
from conveyor.engine.models.deepseek import DeepseekV3ForCausalLM
from conveyor.engine.models.gemma import GemmaForCausalLM
from conveyor.engine.models.gemma4 import Gemma4ForCausalLM
from conveyor.engine.models.glm4_moe import Glm4MoeForCausalLM
from conveyor.engine.models.gpt_oss import GptOssForCausalLM
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import SUPPORTED_ARCHITECTURES, ModelSpec
from conveyor.engine.models.moe import MixtralForCausalLM, MoEForCausalLM
from conveyor.engine.models.olmo3 import Olmo3ForCausalLM
from conveyor.engine.models.phi3 import Phi3ForCausalLM
from conveyor.engine.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from conveyor.engine.models.smollm3 import SmolLM3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM] | type[BertEncoder]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "BertModel": BertEncoder,
    "XLMRobertaModel": BertEncoder,
    "BertForSequenceClassification": BertEncoder,
    "XLMRobertaForSequenceClassification": BertEncoder,
}


def model_class(spec: ModelSpec) -> type[LlamaForCausalLM] | type[BertEncoder]:
    cls = MODEL_CLASSES.get(spec.architecture)
    if cls is None:
        raise ValueError(
            f"architecture {spec.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return cls
