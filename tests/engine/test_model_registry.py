"""Models own their config: each family module declares its architectures and reads its own
config (``FAMILY``), the registry finds them by module, and the central files name no family,
so adding a family is adding one module."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

import conveyor.engine.models as models_package
from conveyor.engine import SamplingParams
from conveyor.engine.models import family as families_found
from conveyor.engine.models import registry
from conveyor.engine.models.family import Family
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import ModelSpec

MODELS_DIR = Path(models_package.__file__).parent
# What every family goes through: adding a family must not need a line in any of them.
CENTRAL_FILES = ("__init__.py", "family.py", "registry.py", "model_config.py", "config_defaults.py", "loader.py")


def _family_modules() -> dict[str, Family]:
    found = {}
    for info in pkgutil.iter_modules(models_package.__path__):
        module = importlib.import_module(f"{models_package.__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if family is not None:
            assert isinstance(family, Family), f"{info.name}.FAMILY is a {type(family).__name__}, not a Family"
            found[info.name] = family
    return found


def test_every_family_module_registers_itself_and_reads_its_own_config() -> None:
    declared = _family_modules()
    assert len(declared) >= 12  # llama, phi3, moe, gemma, gemma4, glm4_moe, gpt_oss, smollm3, olmo3, ...
    assert sorted(map(id, families_found.families())) == sorted(map(id, declared.values()))
    for module, family in declared.items():
        assert family.read_config.__module__ == f"{models_package.__name__}.{module}", module


def test_the_supported_architectures_are_the_families_declarations() -> None:
    declared = [a for f in families_found.families() for a in f.architectures]
    assert {a.name: a.model_type for a in declared} == registry.SUPPORTED_ARCHITECTURES
    assert {a.name: a.model_class for a in declared} == registry.MODEL_CLASSES
    readers = [t for f in families_found.families() for t in f.model_types]
    assert len(readers) == len(set(readers)), "a model_type is read by two families"


def _strings(path: Path) -> set[str]:
    return {
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_the_central_files_name_no_family() -> None:
    names = set(registry.SUPPORTED_ARCHITECTURES) | set(registry.SUPPORTED_ARCHITECTURES.values())
    names |= {wrapper for f in families_found.families() for wrapper in f.wrappers}
    for file in CENTRAL_FILES:
        named = sorted(_strings(MODELS_DIR / file) & names)
        assert not named, f"{file} names families {named}: that knowledge belongs in the family's module"


TOY_FAMILY = '''
"""A family added by one file, as docs/engine/adding-a-family.md walks through."""

from conveyor.engine.models.family import Architecture, CheckpointConfig, Family
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.models.model_config import ModelSpec, decoder_spec


class ToyForCausalLM(LlamaForCausalLM):
    pass


def read_config(config: CheckpointConfig) -> ModelSpec:
    if config.values.get("toy_refused"):
        raise ValueError("toy_refused is not supported")
    return decoder_spec(config, o_bias=bool(config.values.get("attention_bias", False)))


FAMILY = Family(architectures=(Architecture("ToyForCausalLM", "toy", ToyForCausalLM),), read_config=read_config)
'''


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """A new family module on the package's path (the tree itself is left as it is)."""
    (tmp_path / "toy.py").write_text(textwrap.dedent(TOY_FAMILY))
    monkeypatch.setattr(models_package, "__path__", [*models_package.__path__, str(tmp_path)])
    families_found.clear_cache()
    yield importlib.import_module(f"{models_package.__name__}.toy")
    sys.modules.pop(f"{models_package.__name__}.toy", None)
    families_found.clear_cache()


def test_a_family_added_as_one_module_is_served(toy_family, tiny_models, tmp_path, make_llm) -> None:
    llama = tiny_models("llama")
    toy = tmp_path / "toy-model"
    shutil.copytree(llama, toy)
    cfg = json.loads((toy / "config.json").read_text())
    (toy / "config.json").write_text(json.dumps({**cfg, "model_type": "toy", "architectures": ["ToyForCausalLM"]}))

    spec = ModelSpec.from_pretrained(toy)
    assert (spec.model_type, spec.architecture) == ("toy", "ToyForCausalLM")
    assert registry.model_class(spec) is toy_family.ToyForCausalLM
    assert issubclass(registry.model_class(spec), LlamaForCausalLM)
    assert "ToyForCausalLM" in registry.SUPPORTED_ARCHITECTURES
    with pytest.raises(ValueError, match="toy_refused is not supported"):
        ModelSpec.from_dicts({**cfg, "model_type": "toy", "architectures": ["ToyForCausalLM"], "toy_refused": True})

    # The same weights under the new family generate what the Llama family generates.
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = make_llm(llama).generate("The chef", params)[0].token_ids
    assert make_llm(str(toy)).generate("The chef", params)[0].token_ids == expected


def test_without_its_module_the_family_is_refused() -> None:
    with pytest.raises(ValueError, match="model_type 'toy' is not supported"):
        ModelSpec.from_dicts({"model_type": "toy"})
