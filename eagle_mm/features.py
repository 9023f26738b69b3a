"""Capture of target hidden states during the target's own forward, through forward hooks.

Index i follows HF ``hidden_states``: 0 is the input of the first decoder layer (the input embeddings;
in a VLM, the merged text+image embeddings), i < N the input of layer i (= output of layer i-1),
N the final normed output. Nothing in the model is replaced; hooks exist only inside ``with``.
"""
from __future__ import annotations

import torch

from .arch import TargetParts

__all__ = ["FeatureCapture"]


class FeatureCapture:
    """``with FeatureCapture(parts, (2, 5, 9)) as cap: model(...)``; then ``cap.features()`` -> (B, T, 3*hidden)."""

    def __init__(self, parts: TargetParts, indices: tuple[int, ...], device: torch.device | None = None):
        n = parts.num_layers
        bad = [i for i in indices if not 0 <= i <= n]
        if bad:
            raise ValueError(f"hidden_states index {bad} out of range [0, {n}] for a target with {n} layers")
        self.parts, self.indices, self.device = parts, tuple(indices), device
        self._handles: list = []
        self._seen: dict[int, torch.Tensor] = {}

    def _pre_hook(self, idx: int):
        def hook(module, args, kwargs):
            self._seen[idx] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _out_hook(self, module, args, output):
        self._seen[self.parts.num_layers] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def __enter__(self) -> "FeatureCapture":
        for idx in sorted(set(self.indices)):
            if idx < self.parts.num_layers:
                h = self.parts.layers[idx].register_forward_pre_hook(self._pre_hook(idx), with_kwargs=True)
            else:
                h = self.parts.text_model.register_forward_hook(self._out_hook)
            self._handles.append(h)
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def features(self) -> torch.Tensor:
        """The captured states concatenated in ``indices`` order: (B, T, len(indices) * hidden). Clears them."""
        missing = [i for i in self.indices if i not in self._seen]
        if missing:
            raise RuntimeError(f"hidden states {missing} were not captured: the target forward did not run its layers")
        device = self.device or self._seen[self.indices[0]].device
        out = torch.cat([self._seen[i].to(device) for i in self.indices], dim=-1)
        self._seen.clear()
        return out
