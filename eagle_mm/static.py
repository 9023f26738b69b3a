"""Static-shape decoding: a preallocated target cache, fixed verify shapes, and the optional compiled steps.

With ``cache_implementation="static"`` every cycle runs the same shapes: the tree always has
``total_tokens + 1`` nodes (``select_tree`` keeps exactly that many), the target's KV cache is an HF
``StaticCache``-style list of ``StaticLayer`` of a fixed length L, the verify mask is (B, 1, Q, L), the
kept path is always written as D+1 slots (the ones past the accepted length are padding that the next
cycle overwrites), and the head's cache is a fixed buffer with scratch slots for the draft steps. A cycle
is then three compiled functions, each replayed as one CUDA graph on CUDA (``graphs.OwnGraph``): the draft
(``static_cycle.draft_step``), the verify forward here, and the update (``static_cycle.update_step``).

Slots: ``StaticTarget.pos`` (B, L) holds the token position in each cache slot, -1 where empty. The
write pointer is ``cur``: a verify forward writes its Q tree slots at [cur, cur+Q) (HF's ``StaticLayer``
writes at its ``cumulative_length``, which it then advances by Q), the update copies the accepted ones to
[cur, cur+D+1) and sets every layer's ``cumulative_length`` to the new pointer: transformers 5.17's
``StaticLayer`` has no ``crop``, so the pointer is set in place (its tensor address is static) on every
release. Sliding-window layers are stored as full static layers; their window is applied by the mask.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from .cache import LayerKind
from .compat import cache_kwarg
from .graphs import OwnGraph
from .tree import ancestors

logger = logging.getLogger(__name__)

__all__ = ["CACHE_IMPLEMENTATIONS", "resolve_static_options", "static_kinds", "static_masks", "StaticTarget",
           "compiled", "cache_length", "keep_slots"]

CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The decode cycle's graphs are our own (graphs.OwnGraph) rather than inductor's graph trees; False is kept for
# comparing the two (bench/bench_8b.py --graph-trees).
OWN_GRAPHS = True
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


def compiled(owner, name: str, fn, mode: str, *, fullgraph: bool = False, own_graphs: bool = False,
             unkeyed: tuple[int, ...] = ()):
    """``torch.compile(fn, mode=mode, dynamic=False, fullgraph=fullgraph)``, built once per (owner, name, mode).

    With CUDA graphs ("reduce-overhead", "max-autotune") and ``own_graphs=False``, inductor's CUDA graph trees run
    it: every call first marks a new step (the caller has consumed the outputs of the previous call, so the
    graphs may reuse their memory). Inductor quietly runs a graph without CUDA graphs when it cannot capture it,
    e.g. when the graph writes into an input whose address is not static (``mark_static_address``): its skip
    counter is watched here, so that such a graph warns instead of just running slower.

    ``own_graphs=True`` (the decode cycle's three functions): the function is compiled without CUDA graphs and
    captured in one ``torch.cuda.CUDAGraph`` per input signature by ``graphs.OwnGraph``: launching the 8B verify
    that way takes 0.2 ms of host time, against 1.0 ms for a graph-tree call (guards, input checks, output
    rebuilding; bench/results/bench_8b_owngraphs_h200_2026-11-30.json). ``unkeyed``: positional arguments the
    captured graph does not depend on (not part of the signature).
    """
    table = _COMPILED.setdefault(owner, {})
    key = (name, mode, own_graphs)
    if key not in table:
        logger.debug("compiling %s of %s (mode=%s)", name, type(owner).__name__, mode)
        graphs = mode in _CUDA_GRAPH_MODES
        if graphs and own_graphs:
            inner = torch.compile(fn, mode=_NO_GRAPHS[mode], dynamic=False, fullgraph=fullgraph)
            table[key] = OwnGraph(inner, f"{name} of {type(owner).__name__}", unkeyed)
        else:
            inner = torch.compile(fn, mode=mode, dynamic=False, fullgraph=fullgraph)
            table[key] = _with_cudagraphs(inner, f"{name} of {type(owner).__name__}") if graphs else inner
    return table[key]


_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
_NO_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def _with_cudagraphs(inner, what: str):
    from torch._dynamo.utils import counters

    warned = []

    def call(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        skips = counters["inductor"]["cudagraph_skips"]
        out = inner(*args, **kwargs)
        # Inductor counts a skip once per graph: when it compiles it or, for a mutated input, at its first run.
        if counters["inductor"]["cudagraph_skips"] != skips and not warned:
            warned.append(True)
            logger.warning("torch.compile runs the %s without CUDA graphs, launching its kernels one by one. "
                           "TORCH_LOGS=cudagraphs gives the reason: 'mutated inputs' is a tensor written in place "
                           "that is not marked with torch._dynamo.mark_static_address; 'cpu device' means CPU "
                           "tensors, which have no CUDA graphs (compile='default' does the same without this)", what)
        return out

    return call


@dataclass
class _ModelCache:
    batch: int
    cache: object  # the HF Cache of StaticLayers
    pos: torch.Tensor | None = None  # (B, L) slot positions, allocated at the first prefill


def _static_cache(model, batch: int, length: int, n: int) -> _ModelCache:
    """An n-layer static cache of at least ``length`` slots: the model's previous one when it is long enough
    (as ``generate`` reuses its static cache), so that calls with shorter prompts replay the same graphs."""
    from transformers.cache_utils import Cache, StaticLayer

    entry = _CACHES.get(model)
    if (entry is None or len(entry.cache.layers) != n or entry.batch != batch
            or entry.cache.layers[0].max_cache_len < length):
        entry = _ModelCache(batch, Cache(layers=[StaticLayer(max_cache_len=length) for _ in range(n)]))
        _CACHES[model] = entry  # one live cache per model: a new shape frees the old one
    entry.cache.reset()  # zeros the stored slots and every layer's cumulative_length, in place
    return entry


class StaticTarget:
    """The target's static cache, its slot positions and write pointer, and the (compiled) verify."""

    def __init__(self, model, batch: int, length: int, kinds: list[LayerKind], mode: str | None):
        self.model, self.kinds, self.mode = model, kinds, mode
        self._cache_kwarg = cache_kwarg(model)
        self._entry = _static_cache(model, batch, length, len(kinds))
        self.cache = self._entry.cache
        self.length = self.cache.layers[0].max_cache_len
        self.cur = 0  # on the host, for the room checks; the update graph keeps its own copy on the device
        self.pos: torch.Tensor | None = None  # (B, L)
        self._verify = (compiled(model, "verify", _verify_forward, mode, own_graphs=OWN_GRAPHS, unkeyed=(4,))
                        if mode else _verify_forward)
        # Inductor's graph trees free a graph's outputs when the next graph runs, and the update graph reads the
        # features: they are copied out first (eagle_mm's own graphs keep them until the verify runs again).
        self._copy_feats = mode in _CUDA_GRAPH_MODES and not OWN_GRAPHS

    def prefilled(self, slot_pos: torch.Tensor) -> None:
        """After the prefill forward over T prompt slots: their positions (B, T), -1 for padding."""
        B, T = slot_pos.shape
        pos = self._entry.pos
        if pos is None or pos.device != slot_pos.device:
            # Kept between calls at one address: the update graph writes it in place under CUDA graphs.
            pos = self._entry.pos = slot_pos.new_empty(B, self.length)
            torch._dynamo.mark_static_address(pos)
        pos.fill_(-1)
        pos[:, :T] = slot_pos
        self.pos, self.cur = pos, T

    def verify(self, cap, tokens: torch.Tensor, q_pos: torch.Tensor, parent: torch.Tensor, depth: int,
               position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target logits (B, Q, V) and features (B, Q, F) (``cap``'s) at the Q tree nodes, written to slots
        [cur, cur+Q)."""
        Q = tokens.shape[1]
        if self.cur + Q > self.length:
            raise RuntimeError(f"static cache of {self.length} slots is full ({self.cur} used, a tree needs {Q})")
        write = torch.arange(self.cur, self.cur + Q, device=tokens.device)
        logits, feats = self._verify(self.model, self.cache, self.kinds, self._cache_kwarg, cap, tokens, q_pos,
                                     parent, self.pos, write, position_ids, depth)
        return logits, feats.clone() if self._copy_feats else feats

    def layers(self) -> tuple[list, list, list]:
        """Keys, values and write pointers (``cumulative_length``) of the initialized layers."""
        layers = [layer for layer in self.cache.layers if layer.is_initialized]
        return [la.keys for la in layers], [la.values for la in layers], [la.cumulative_length for la in layers]


def _verify_forward(model, cache, kinds, kwarg: str, cap, tokens, q_pos, parent, slot_pos, write, position_ids,
                    depth: int):
    """The verify step as one function of tensors (mask building included), so that it compiles whole. Returns
    the logits and ``cap``'s features: a replayed CUDA graph runs no hooks, so the features are outputs."""
    anc = ancestors(parent, depth)  # (B, Q, Q)
    masks = static_masks(kinds, slot_pos, q_pos, anc, write, model.dtype)
    logits = model(input_ids=tokens, attention_mask=masks, position_ids=position_ids, **{kwarg: cache},
                   use_cache=True).logits
    return logits, cap.features()


def keep_slots(keys: list, values: list, lengths: list, src: torch.Tensor, dst: torch.Tensor,
               new_len: torch.Tensor) -> None:
    """In place, per layer: slots dst (K,) <- slots src (B, K) of each row; the write pointer <- new_len."""
    for t in (*keys, *values):
        B, h, _, d = t.shape
        idx = src.to(t.device)[:, None, :, None].expand(B, h, -1, d)
        t.index_copy_(2, dst.to(t.device), t.gather(2, idx))  # gather first: source and target may overlap
    for n in lengths:
        n.copy_(new_len)
