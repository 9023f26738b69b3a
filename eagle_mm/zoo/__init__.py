"""Reference models built from scratch by scripts in this package (see docs/reference-models.md).

``eagle_mm.zoo.load("code-tiny")`` returns a ``ZooModel``: a small Python-code ``LlamaForCausalLM``, its tokenizer,
a trained EAGLE head, a trained EAGLE-3 head and a 2-layer assistant, all read from local files.
``python -m eagle_mm.zoo.code_tiny build --out DIR --seed 0`` rebuilds them.
"""
from .registry import MODELS, ZOO_ENV, ScenesModel, ZooModel, is_available, load, load_dir, load_scenes_dir, model_dir

__all__ = ["load", "load_dir", "load_scenes_dir", "model_dir", "is_available", "ZooModel", "ScenesModel", "MODELS",
           "ZOO_ENV"]
