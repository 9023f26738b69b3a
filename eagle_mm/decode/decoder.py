"""One decoder per (target model, draft head, device): everything the engine keeps between calls, on one object.

As vLLM's ``EagleProposer`` holds a drafter's buffers, a ``Decoder`` holds the lock that makes the calls on it take
turns, the storage (the target's static cache, the head's buffers: ``storage.py``), the runner (the CUDA graphs and
compiled steps bound to that storage: ``runner.py``), one generator-less draft sampler per warper setting (what a
captured draft is keyed on) and the feature capture (hooks on the target's layers, present only inside a call).
``decoder(model, head)`` returns it, made on first use; ``close()`` frees what it holds. The decode loop
(``loop.py``) runs the steps on it, one call at a time.

A head's decoders live in a table on the head object, weakly keyed by the target model (a decoder does not keep its
target alive), so that nothing is held at module level. Copying or pickling a head copies no decoder.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict

import torch

from ..target.compat import cache_kwarg
from ..target.features import FeatureCapture
from ..target.parts import execution_device, resolve_target
from .draft import scratch_slots
from .masks import layer_kinds
from .runner import Runner
from .storage import Storage, cache_length, prefill_length

__all__ = ["Decoder", "decoder"]

_TABLE = "_eagle_mm_decoders"  # the attribute of a head that holds its decoders
_MAKING = threading.Lock()  # makes each decoder once when threads ask for it together
_SAMPLERS_KEPT = 16


class _Decoders(weakref.WeakKeyDictionary):
    """model -> {device: Decoder}. Never copied or pickled with its head: a copy starts without decoders."""

    def __deepcopy__(self, memo):
        return type(self)()

    def __reduce__(self):
        return type(self), ()


def decoder(model, head, device=None) -> "Decoder":
    """The decoder of ``model`` with ``head`` on ``device`` (default: where the model's input embeddings compute),
    made on first use. ``speculative_generate`` decodes through it; its ``close()`` frees its memory."""
    device = torch.device(device) if device is not None else execution_device(model.get_input_embeddings())
    with _MAKING:
        table = vars(head).get(_TABLE)
        if table is None:
            table = _Decoders()
            object.__setattr__(head, _TABLE, table)  # a plain attribute, never a module, parameter or buffer
        per_device = table.setdefault(model, {})
        dec = per_device.get(device)
        if dec is None:
            dec = per_device[device] = Decoder(model, head, device)
        return dec


class Decoder:
    """The engine's state for one (target, head, device), kept between calls. Make it with ``decoder()``.

    ``lock``: calls on one decoder take turns. ``storage`` holds the memory, ``runner`` the steps as they run
    (captured or compiled ones bound to that memory); ``setup`` is the seconds spent compiling and capturing so far.
    During a call: ``tree`` (the call's TreeConfig), ``sampler`` (sampling: the draft sampler the steps are keyed on)
    and ``generator`` (the call's).
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
        self._running = False
        self.tree = self.sampler = self.generator = None

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise RuntimeError("this decoder's target model no longer exists")
        return model

    @property
    def head(self):
        head = self._head()
        if head is None:
            raise RuntimeError("this decoder's draft head no longer exists")
        return head

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
            self._capture = self.tree = self.sampler = self.generator = None
            model, head = self._model(), self._head()
            table = vars(head).get(_TABLE, {}) if head is not None else {}
            per_device = table.get(model, {}) if model is not None else {}
            if per_device.get(self.device) is self:
                del per_device[self.device]

    def begin(self, tree, mode: str | None, batch: int, prompt_len: int, max_length: int, sampler=None) -> None:
        """Ready the storage and the runner for a call: ``tree`` (TreeConfig), ``mode`` (``options.choose_mode``),
        ``batch`` rows of prompts ``prompt_len`` long, up to ``max_length`` tokens; ``sampler`` when sampling."""
        model = self.model
        parts = resolve_target(model)
        self.tree, self.generator = tree, sampler.generator if sampler is not None else None
        self.sampler = self._graph_sampler(sampler) if sampler is not None else None
        new = max_length - prompt_len  # the prompt takes its bucket's slots (text) or its own (images): the larger
        length = cache_length(prefill_length(prompt_len), prefill_length(prompt_len) + new, batch,
                              tree.total_tokens + 1, tree.depth)
        kinds = tuple(layer_kinds(parts.text_config, parts.num_layers))
        if self.storage.prepare(parts.num_layers, batch, length, kinds, cache_kwarg(model), eager=mode is None):
            self.runner.reset()  # graphs bound to the old memory
        self.runner.begin(mode, self.storage, tree, self.device)

    def start(self, k, v, head_pos, root, root_pos, root_out, root_logits) -> None:
        """The prefill's head entries k, v (B, nkv, S, hd) at head_pos (B, S) and the root, into the buffers."""
        t, s = self.tree, self.sampler
        if self.storage.start(k, v, head_pos, root, root_pos, root_out, root_logits,
                              scratch=scratch_slots(t.top_k, t.depth), q_len=t.total_tokens + 1,
                              vocab=s.vocab_size if s is not None else None, width=s.width if s is not None else None):
            self.runner.reset()  # graphs bound to the old buffers
            self.runner.begin(self.runner.mode, self.storage, t, self.device)

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
