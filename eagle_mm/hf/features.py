"""Capture of target hidden states during the target's own forward, through forward hooks.

Index i follows HF ``hidden_states``: 0 is the input of the first decoder layer (the input embeddings;
in a VLM, the merged text+image embeddings), i < N the input of layer i (= output of layer i-1),
N the final normed output. Nothing in the model is replaced; hooks exist only inside ``with``.
Index i is taken as layer i receives it: Qwen3-VL adds its deepstack image features to the output of its
first layers before the next one reads it, and HF's ``hidden_states`` record that output before the addition.

Each capture records only the forwards run by the thread that entered it: several threads may decode with one
model at once, each capture seeing its own thread's states (a forward runs its hooks in the calling thread).

A target split by a ``device_map`` hands each hook its state on the device of the layer before it; the captured
states are gathered onto one device: ``device``, by default where the input embeddings compute (where
``speculative_generate`` keeps its token tensors and a head made by ``from_target`` lives).
"""
from __future__ import annotations

import threading

import torch

from .parts import TargetParts, execution_device

__all__ = ["FeatureCapture"]


class FeatureCapture:
    """``with FeatureCapture(parts, (2, 5, 9)) as cap: model(...)``; then ``cap.features()`` -> (B, T, 3*hidden).

    ``device``: where the captured states are gathered (default: the input embeddings' execution device).

    ``input_embeds=True`` also keeps the input of layer 0 of each forward for ``cap.input_embeds()``: in a VLM, the
    merged text and image embeddings the language model received.
    """

    def __init__(self, parts: TargetParts, indices: tuple[int, ...], device: torch.device | None = None, *,
                 input_embeds: bool = False):
        n = parts.num_layers
        bad = [i for i in indices if not 0 <= i <= n]
        if bad:
            raise ValueError(f"hidden_states index {bad} out of range [0, {n}] for a target with {n} layers")
        self.parts, self.indices, self.device = parts, tuple(indices), device
        self._states = len(set(self.indices))  # distinct states a forward records
        self.keeps_input_embeds = input_embeds
        self._handles: list = []
        self._seen: dict[int, torch.Tensor] = {}
        self._embeds: torch.Tensor | None = None
        self._owner: int | None = None  # the thread that entered the ``with``
        self._to: torch.device | None = None  # where the states are gathered, found when the ``with`` is entered

    # Each hook records only its owner thread's forwards. Traced under torch.compile (the engine's compiled verify),
    # the check folds away: a compiled forward is bound to its one caller's cache anyway.
    def _pre_hook(self, idx: int):
        def hook(module, args, kwargs):
            if not (torch.compiler.is_compiling() or threading.get_ident() == self._owner):
                return
            state = args[0] if args else kwargs["hidden_states"]
            if idx in self.indices:
                self._seen[idx] = state
            if idx == 0 and self.keeps_input_embeds:
                self._embeds = state

        return hook

    def _out_hook(self, module, args, output):
        if not (torch.compiler.is_compiling() or threading.get_ident() == self._owner):
            return
        self._seen[self.parts.num_layers] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def __enter__(self) -> "FeatureCapture":
        self._owner, self._to = threading.get_ident(), self._gather_device()
        for idx in sorted(set(self.indices) | ({0} if self.keeps_input_embeds else set())):
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
        self._embeds = self._to = None

    def features(self) -> torch.Tensor:
        """The captured states concatenated in ``indices`` order: (B, T, len(indices) * hidden). Clears them."""
        if len(self._seen) < self._states:
            missing = [i for i in self.indices if i not in self._seen]
            raise RuntimeError(f"hidden states {missing} were not captured: the target forward did not run its layers")
        device = self._to if self._to is not None else self._gather_device()
        out = torch.cat([self._seen[i].to(device) for i in self.indices], dim=-1)
        self._seen.clear()
        return out

    def input_embeds(self) -> torch.Tensor:
        """The input of decoder layer 0 in the last forward: (B, T, hidden). Clears it."""
        if self._embeds is None:
            raise RuntimeError("no input embeddings were captured: create FeatureCapture(..., input_embeds=True) "
                               "and run a target forward first")
        out, self._embeds = self._embeds, None
        return out.to(self._gather_device())

    def _gather_device(self) -> torch.device:
        return self.device if self.device is not None else execution_device(self.parts.embed)
