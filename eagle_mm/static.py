"""Static-shape decoding: a preallocated target cache, fixed verify shapes, and the optional compiled steps.

With ``cache_implementation="static"`` every cycle runs the same shapes: the tree always has
``total_tokens + 1`` nodes (``select_tree`` keeps exactly that many), the target's KV cache is an HF
``StaticCache``-style list of ``StaticLayer`` of a fixed length L, the verify mask is (B, 1, Q, L), the
kept path is always written as D+1 slots (the ones past the accepted length are padding that the next
cycle overwrites), and the head's cache is a fixed buffer with scratch slots for the draft steps. One
compiled graph then serves every cycle of the verify forward, one every draft step and one the head's
update (``torch.compile(mode="reduce-overhead")``: CUDA graphs).

Slots: ``StaticTarget.pos`` (B, L) holds the token position in each cache slot, -1 where empty. The
write pointer is ``cur``: a verify forward writes its Q tree slots at [cur, cur+Q) (HF's ``StaticLayer``
writes at its ``cumulative_length``, which it then advances by Q), ``keep`` copies the accepted ones to
[cur, cur+D+1) and sets every layer's ``cumulative_length`` to the new pointer: transformers 5.17's
``StaticLayer`` has no ``crop``, so the pointer is set in place (its tensor address is static) on every
release. Sliding-window layers are stored as full static layers; their window is applied by the mask.
"""
from __future__ import annotations

import logging
import weakref

import torch

from .cache import LayerKind
from .compat import cache_kwarg
from .tree import ancestors

logger = logging.getLogger(__name__)

__all__ = ["CACHE_IMPLEMENTATIONS", "resolve_static_options", "static_kinds", "static_masks", "StaticTarget",
           "compiled", "cache_length"]

CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_SLOT_ROUND = 128  # cache lengths are rounded up so that repeated calls reuse one cache and one graph


def resolve_static_options(cache_implementation, compile) -> tuple[bool, str | None]:
    """(static, compile mode or None) from speculative_generate's options.

    compile: None = compile on CUDA when the cache is static (as ``generate`` does with a static cache),
    True = "reduce-overhead", False = never, or a ``torch.compile`` mode name.
    """
    if cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(f"cache_implementation={cache_implementation!r} is not supported; expected one of "
                         f"{CACHE_IMPLEMENTATIONS[1:]} (or None for 'dynamic')")
    static = cache_implementation == "static"
    if compile is None or compile is False:
        return static, None if compile is False else ("auto" if static else None)
    mode = "reduce-overhead" if compile is True else compile
    if not isinstance(mode, str) or mode not in COMPILE_MODES:
        raise ValueError(f"compile={compile!r}: expected None, True, False or a torch.compile mode {COMPILE_MODES}")
    if not static:
        raise ValueError(f"compile={compile!r} needs fixed shapes: pass cache_implementation='static' too")
    return static, mode


def cache_length(prompt_len: int, max_length: int, batch: int, q_len: int, depth: int) -> int:
    """Static cache slots: the prompt, every committed token, one tree, rounded up.

    One row commits at least one token per cycle and the pointer advances by the longest accepted path,
    so with B = 1 the committed slots are exactly the new tokens; with B > 1 rows that accept less
    leave holes, up to D+1 slots per cycle.
    """
    new = max_length - prompt_len
    committed = new if batch == 1 else new * (depth + 1)
    need = prompt_len + committed + q_len + depth + 1
    return -(-need // _SLOT_ROUND) * _SLOT_ROUND


def static_kinds(text_config, num_layers: int) -> list[LayerKind]:
    """Each layer's attention kind from the config alone (a static cache stores every layer in full)."""
    types = getattr(text_config, "layer_types", None)
    window = getattr(text_config, "sliding_window", None)
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * num_layers
    kinds = []
    for i, name in enumerate(types):
        if name == "full_attention":
            kinds.append(LayerKind(name))
        elif name == "sliding_attention" and window:
            kinds.append(LayerKind(name, window=window))
        else:
            raise ValueError(f"layer {i} has attention type {name!r}, which cache_implementation='static' does not "
                             f"support; use the dynamic cache")
    return kinds


def static_masks(kinds: list[LayerKind], slot_pos: torch.Tensor, q_pos: torch.Tensor, q_allowed: torch.Tensor,
                 write: torch.Tensor, dtype: torch.dtype):
    """Additive masks (B, 1, Q, L) for Q new tokens written at slots ``write`` (Q,) of an L-slot cache.

    slot_pos (B, L) positions of the stored slots (-1 empty, including the Q slots being written);
    q_allowed (B, Q, Q): which new tokens each new token may see. One tensor, or a dict by layer type.
    """
    neg = torch.finfo(dtype).min
    B, Q = q_pos.shape
    masks = {}
    for kind in kinds:
        if kind.name in masks:
            continue
        qp, kp = q_pos[:, :, None], slot_pos[:, None, :]  # (B, Q, 1), (B, 1, L)
        ok = (kp >= 0) & (kp <= qp)
        if kind.window is not None:
            ok = ok & (qp - kp < kind.window)
        ok = ok.scatter(2, write[None, None, :].expand(B, Q, Q), q_allowed)  # (B, Q, L)
        masks[kind.name] = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, neg)[:, None]
    return next(iter(masks.values())) if len(masks) == 1 else masks


# One cache per (model, shape), kept between calls: a compiled graph is bound to the cache's addresses.
_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compiled(owner, name: str, fn, mode: str):
    """``torch.compile(fn, mode=mode, dynamic=False)``, built once per (owner object, name, mode).

    With CUDA graphs ("reduce-overhead") every call first marks a new step: the caller has consumed the
    outputs of the previous call (copied, gathered or reduced them), so the graphs may reuse their memory.
    """
    table = _COMPILED.setdefault(owner, {})
    key = (name, mode)
    if key not in table:
        logger.debug("compiling %s of %s (mode=%s)", name, type(owner).__name__, mode)
        inner = torch.compile(fn, mode=mode, dynamic=False)
        if mode == "reduce-overhead":
            def call(*args, **kwargs):
                torch.compiler.cudagraph_mark_step_begin()
                return inner(*args, **kwargs)
            table[key] = call
        else:
            table[key] = inner
    return table[key]


def _static_cache(model, batch: int, length: int, n: int):
    """An n-layer static cache of at least ``length`` slots: the model's previous one when it is long enough
    (as ``generate`` reuses its static cache), so that calls with shorter prompts replay the same graphs."""
    from transformers.cache_utils import Cache, StaticLayer

    old_batch, cache = _CACHES.get(model, (None, None))
    if cache is None or len(cache.layers) != n or old_batch != batch or cache.layers[0].max_cache_len < length:
        cache = Cache(layers=[StaticLayer(max_cache_len=length) for _ in range(n)])
        _CACHES[model] = (batch, cache)  # one live cache per model: a new shape frees the old one
    cache.reset()  # zeros the stored slots and every layer's cumulative_length, in place
    return cache


class StaticTarget:
    """The target's static cache, its slot positions and write pointer, and the (compiled) verify."""

    def __init__(self, model, batch: int, length: int, kinds: list[LayerKind], mode: str | None):
        self.model, self.kinds, self.mode = model, kinds, mode
        self._cache_kwarg = cache_kwarg(model)
        self.cache = _static_cache(model, batch, length, len(kinds))
        self.length = self.cache.layers[0].max_cache_len
        self.cur = 0
        self.pos: torch.Tensor | None = None  # (B, L)
        self._verify = compiled(model, "verify", _verify_forward, mode) if mode else _verify_forward
        self._keep = compiled(model, "keep", _keep_slots, mode) if mode else _keep_slots

    def prefilled(self, slot_pos: torch.Tensor) -> None:
        """After the prefill forward over T prompt slots: their positions (B, T), -1 for padding."""
        B, T = slot_pos.shape
        self.pos = slot_pos.new_full((B, self.length), -1)
        self.pos[:, :T] = slot_pos
        self.cur = T

    def verify(self, tokens: torch.Tensor, q_pos: torch.Tensor, parent: torch.Tensor, depth: int,
               position_ids: torch.Tensor) -> torch.Tensor:
        """Target logits (B, Q, V) at the Q tree nodes, written to slots [cur, cur+Q)."""
        Q = tokens.shape[1]
        if self.cur + Q > self.length:
            raise RuntimeError(f"static cache of {self.length} slots is full ({self.cur} used, a tree needs {Q})")
        write = torch.arange(self.cur, self.cur + Q, device=tokens.device)
        return self._verify(self.model, self.cache, self.kinds, self._cache_kwarg, tokens, q_pos, parent, self.pos,
                            write, position_ids, depth)

    def keep(self, keep: torch.Tensor, new_pos: torch.Tensor, advance: int) -> None:
        """Copy the kept tree slots keep (B, K) (K fixed: D+1) to [cur, cur+K), positions new_pos (B, K)
        (-1 = padding), and move the write pointer ``advance`` slots on."""
        K = keep.shape[1]
        if self.cur + K > self.length:
            raise RuntimeError(f"static cache of {self.length} slots is full ({self.cur} used, a path needs {K})")
        dev = keep.device
        src = keep + self.cur  # (B, K) slots written by the verify
        dst = torch.arange(self.cur, self.cur + K, device=dev)  # (K,)
        new_len = dst[0] + advance  # () on the device: a host tensor here would cost a copy and a sync
        layers = [layer for layer in self.cache.layers if layer.is_initialized]
        self._keep([layer.keys for layer in layers], [layer.values for layer in layers],
                   [layer.cumulative_length for layer in layers], src, dst, new_len)
        self.pos[:, self.cur:self.cur + K] = new_pos
        self.cur += advance


def _verify_forward(model, cache, kinds, kwarg: str, tokens, q_pos, parent, slot_pos, write, position_ids,
                    depth: int):
    """The verify step as one function of tensors (mask building included), so that it compiles whole."""
    anc = ancestors(parent, depth)  # (B, Q, Q)
    masks = static_masks(kinds, slot_pos, q_pos, anc, write, model.dtype)
    return model(input_ids=tokens, attention_mask=masks, position_ids=position_ids, **{kwarg: cache},
                 use_cache=True).logits


def _keep_slots(keys: list, values: list, lengths: list, src: torch.Tensor, dst: torch.Tensor,
                new_len: torch.Tensor) -> None:
    """In place, per layer: slots dst (K,) <- slots src (B, K) of each row; the write pointer <- new_len."""
    for t in (*keys, *values):
        B, h, _, d = t.shape
        idx = src.to(t.device)[:, None, :, None].expand(B, h, -1, d)
        t.index_copy_(2, dst.to(t.device), t.gather(2, idx))  # gather first: source and target may overlap
    for n in lengths:
        n.copy_(new_len)
