"""One decoder per (target model, draft head, device): everything the engine keeps between calls, on one object.

As vLLM's ``EagleProposer`` holds a drafter's buffers, a ``Decoder`` holds the lock that makes the calls on it take
turns, the copy of the head it decodes with (``bound.py``: never the caller's head), the storage (the target's
static cache, the head's buffers: ``storage.py``), the runner (the CUDA graphs and compiled steps bound to that
storage: ``runner.py``), one generator-less draft sampler per warper setting (what a captured draft is keyed on), the
feature capture (hooks on the target's layers, present only inside a call) and the tree chooser (``chooser.py``: the
step costs measured on this device, the acceptance the head gets). ``decoder(model, head)`` returns
it, made on first use; ``close()`` frees what it holds, and ``release(model, head=None)`` closes a model's decoders.
The decode loop (``loop.py``) runs the steps on it, one call at a time.

A head's decoders live in a table on the head object, weakly keyed by the target model, and refer back to neither
(dropping either frees them at once). Copying or pickling a head copies no decoder. The one module-level table is
an index of weak references from a model to the heads that decoded with it, for ``release(model)``: it holds no
state of the engine's.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict

import torch

from ..hf.compat import cache_kwarg
from ..hf.features import FeatureCapture
from ..heads.base import PerTarget
from ..hf.parts import execution_device, resolve_target
from .bound import head_copy, stamp
from .draft import scratch_slots
from .masks import layer_kinds
from .runner import Runner
from .storage import Storage, cache_length, first_length, prefill_length

__all__ = ["Decoder", "decoder", "release"]

_TABLE = "_per_target"  # the attribute of a head that holds its decoders (``DraftHead`` makes it; a wrapper gets one)
_MAKING = threading.Lock()  # makes each decoder once when threads ask for it together
_SAMPLERS_KEPT = 16
_HEADS_OF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> WeakSet of heads (release's index)


def decoder(model, head, device=None) -> "Decoder":
    """The decoder of ``model`` with ``head`` on ``device`` (default: where the model's input embeddings compute),
    made on first use. ``speculative_generate`` decodes through it; its ``close()`` frees its memory."""
    device = torch.device(device) if device is not None else execution_device(model.get_input_embeddings())
    with _MAKING:
        table = vars(head).get(_TABLE)  # model -> {device: Decoder}
        if table is None:  # an object that only behaves like a head (a wrapper around one)
            table = PerTarget()
            object.__setattr__(head, _TABLE, table)  # a plain attribute, never a module, parameter or buffer
        per_device = table.setdefault(model, {})
        dec = per_device.get(device)
        if dec is None:
            dec = per_device[device] = Decoder(model, head, device)
            _HEADS_OF.setdefault(model, weakref.WeakSet()).add(head)
        return dec


def release(model, head=None) -> None:
    """Free what the engine keeps for ``model`` between calls: the KV cache, head buffers, captured graphs, compiled
    steps and head copies of its decoder with ``head`` (of every head used with ``model`` when None; ``close()`` of
    each). Waits for a call on them to finish. The memory goes back to PyTorch's allocator
    (``torch.cuda.empty_cache()`` hands it to the driver); the next call allocates and captures again. A call also
    frees the kept cache itself when it can use fewer slots than that cache holds."""
    with _MAKING:
        heads = [head] if head is not None else list(_HEADS_OF.get(model, ()))
        decoders = [d for h in heads for d in (vars(h).get(_TABLE) or {}).get(model, {}).values()]
    for dec in decoders:
        dec.close()


class Decoder:
    """The engine's state for one (target, head, device), kept between calls. Make it with ``decoder()``.

    ``lock``: calls on one decoder take turns. ``storage`` holds the memory, ``runner`` the steps as they run
    (captured or compiled ones bound to that memory); ``setup`` is the seconds spent compiling and capturing so far.
    During a call: ``tree`` (the TreeConfig the next cycle drafts), ``capacity`` (the largest tree the call may switch
    to: the buffers are sized for it), ``sampler`` (sampling: the draft sampler the steps are keyed on) and
    ``generator`` (the call's). ``chooser``: the default call's tree chooser, made on first use.
    """

    def __init__(self, model, head, device: torch.device):
        # Both weakly: the head holds its decoders, which must not keep it (or its target) alive.
        self._model, self._head = weakref.ref(model), weakref.ref(head)
        self.device = device
        # Whether the device runs queued work behind the host (CUDA): the loop then launches the next draft before it
        # waits for the cycle's host read, so that the device drafts while the host commits.
        self.overlaps = device.type == "cuda"
        self.lock = threading.RLock()
        self.storage = Storage()
        self.runner = Runner()
        self._samplers: OrderedDict = OrderedDict()  # DraftSampler.settings() -> generator-less sampler
        self._capture: FeatureCapture | None = None
        self._bound = None  # (stamp, the head copy this decoder decodes with)
        self._running = False
        self._chooser = None
        self.tree = self.capacity = self.sampler = self.generator = None

    @property
    def model(self):
        return _alive(self._model, "target model")

    @property
    def head(self):
        return _alive(self._head, "draft head")

    @property
    def chooser(self):
        """The tree chooser of this model, head and device (``chooser.Chooser``), made on first use."""
        if self._chooser is None:
            from .chooser import Chooser

            self._chooser = Chooser(self.model, self.head, self.device)
        return self._chooser

    @property
    def setup(self) -> float:
        """Seconds its steps have spent compiling or capturing, over all calls so far."""
        return self.runner.setup

    @contextlib.contextmanager
    def running(self):
        """``with dec.running() as cap``: one call at a time (the lock), with the feature capture of the head's layers
        (``cap``: its hooks exist inside the block only). A call nested in a running one (from a stopping criterion,
        say) would overwrite that call's cache: it is refused."""
        with self.lock:
            if self._running:
                raise RuntimeError("speculative_generate was called with this model and head inside a call that is "
                                   "decoding with them (a callback of it, in the same thread); finish that call first")
            self._running = True
            try:
                if self._capture is None:
                    parts = resolve_target(self.model)
                    self._capture = FeatureCapture(parts, self.head.feature_layers(parts.num_layers),
                                                   input_embeds=self.head.reads_images(parts))
                with self._capture as cap:
                    yield cap
            finally:
                self._running = False

    def close(self) -> None:
        """Free the cache, the buffers, the captured graphs and compiled steps, and forget this decoder: the next call
        with this model and head makes a new one."""
        with self.lock:
            self.storage.release()
            self.runner.reset()
            self._samplers.clear()
            self._capture = self._bound = self._chooser = None
            self.tree = self.capacity = self.sampler = self.generator = None
            model, head = self._model(), self._head()
            table = vars(head).get(_TABLE, {}) if head is not None else {}
            per_device = table.get(model, {}) if model is not None else {}
            if per_device.get(self.device) is self:
                del per_device[self.device]

    def bind(self, dtype: torch.dtype):
        """The copy of the head a call decodes with, attached to the target (whose embeddings are ``dtype``): kept
        from an earlier call while the head's tensors have not changed (``bound.stamp``); the head itself when it only
        behaves like one."""
        head, now = self.head, stamp(self.head, dtype)
        if now is None:  # not kept: it is the head itself, which holds this decoder
            head.attach(self.model)  # a wrapper's attach may hand back the head it wraps: decode with the wrapper
            return head
        if self._bound is None or self._bound[0] != now:
            # A shallow copy would share the head's table of decoders (and keep this decoder alive through it).
            self._bound = (now, head_copy(head, dtype, drop=(_TABLE,)))
        return self._bound[1].attach(self.model)

    def begin(self, tree, mode: str | None, batch: int, prompt_len: int, max_length: int, sampler=None, *,
              capacity=None) -> None:
        """Ready the storage and the runner for a call: ``tree`` (TreeConfig) to draft first, ``capacity`` the largest
        tree it may switch to (default ``tree``), ``mode`` (``options.choose_mode``), ``batch`` rows of prompts
        ``prompt_len`` long, up to ``max_length`` tokens; ``sampler`` when sampling."""
        model = self.model
        parts = resolve_target(model)
        capacity = capacity if capacity is not None else tree
        if not tree.fits(capacity):
            raise ValueError(f"{tree} does not fit the capacity {capacity} the buffers are sized for")
        self.tree, self.capacity = tree, capacity
        self.generator = sampler.generator if sampler is not None else None
        self.sampler = self._graph_sampler(sampler) if sampler is not None else None
        # The prompt takes its bucket's slots (text) or its own (images): the larger.
        prompt_slots, q_len, grows = prefill_length(prompt_len), capacity.total_tokens + 1, mode in (None, "graphs")
        limit = cache_length(prompt_slots, prompt_slots + max_length - prompt_len, batch, q_len, capacity.depth)
        first = first_length(prompt_slots, limit, q_len, capacity.depth) if grows else limit
        kinds = tuple(layer_kinds(parts.text_config, parts.num_layers))
        generation = self.storage.generation
        self.storage.prepare(parts.num_layers, batch, limit, first, kinds, cache_kwarg(model), eager=mode is None,
                             grows=grows)
        self.storage.set_tree(tree)
        if self.storage.generation != generation:
            self.runner.reset()  # graphs bound to the old memory
        self.runner.begin(mode, self.storage, self.device)

    def start(self, k, v, head_pos, root, root_pos, root_out, root_logits) -> None:
        """The prefill's head entries k, v (B, nkv, S, hd) at head_pos (B, S) and the root, into the buffers."""
        t, s = self.capacity, self.sampler
        self.storage.start(k, v, head_pos, root, root_pos, root_out, root_logits,
                           scratch=max(0, scratch_slots(t.top_k, t.depth)), q_len=t.total_tokens + 1,
                           vocab=s.vocab_size if s is not None else None, width=s.width if s is not None else None)

    def set_tree(self, tree) -> None:
        """Draft ``tree`` (within the call's capacity) from the next cycle on."""
        if tree != self.tree:
            if not tree.fits(self.capacity):
                raise ValueError(f"{tree} does not fit the capacity {self.capacity} the buffers are sized for")
            self.tree = tree
            self.storage.set_tree(tree)

    def reserve(self) -> None:
        """Room for the next cycle's tree: the storage grows first where it must; its graphs are then captured anew
        (the ones bound to the old memory are dropped)."""
        generation = self.storage.generation
        self.storage.reserve(self.tree.total_tokens + 1)
        if self.storage.generation != generation:
            self.runner.reset()
            self.runner.begin(self.runner.mode, self.storage, self.device)

    def _graph_sampler(self, sampler):
        """One generator-less sampler per warper setting: what the captured draft step is keyed on, so that later
        calls with the same settings replay its graph (its noise is drawn outside, from the call's generator)."""
        key = sampler.settings()
        kept = self._samplers.get(key)
        if kept is None or not torch.equal(kept.target_ids, sampler.target_ids):
            kept = self._samplers[key] = type(sampler)(sampler.warpers, sampler.target_ids, sampler.vocab_size, None,
                                                       sampler.width, sampler.compact)
        self._samplers.move_to_end(key)
        while len(self._samplers) > _SAMPLERS_KEPT:
            self._samplers.popitem(last=False)
        return kept


def _alive(ref, what: str):
    obj = ref()
    if obj is None:
        raise RuntimeError(f"this decoder's {what} no longer exists")
    return obj
