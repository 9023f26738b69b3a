"""speculative_generate: prefill -> draft -> verify -> accept -> update, as a drop-in for ``generate``.

Decode state lives in one ``DecodeState``; tree and acceptance math are the pure functions of
``tree.py``; cache bookkeeping is ``cache.py``; the head side is ``draft.py``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from .arch import resolve_target
from .cache import CacheSnapshot, SlotBook, build_masks, keep_path, layer_kinds
from .compat import cache_kwarg, output_cache
from .config import TreeConfig
from .draft import HeadCache, draft_tree, extend_head
from .features import FeatureCapture
from .options import eos_ids, pad_id, resolve_generation_config
from .tree import ancestors, greedy_accept, path_indices

logger = logging.getLogger(__name__)

__all__ = ["speculative_generate", "SpeculativeOutput", "SpeculativeStats"]


@dataclass
class SpeculativeStats:
    """Acceptance statistics of one call; acceptance counts are before any stopping truncation."""

    num_target_forwards: int = 0  # verify forwards (the prefill is not counted)
    num_drafts: int = 0  # (row, cycle) pairs drafted
    num_draft_tokens: int = 0  # draft nodes sent to verification, over all rows
    accept_counts: list[int] = field(default_factory=list)  # [i]: drafts whose accepted length >= i+1
    accepted_tokens: int = 0  # tokens gained from verify forwards (accepted + bonus)
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_other: float = 0.0

    @property
    def mean_accept_length(self) -> float:
        """Tokens per target forward and row, the bonus token included."""
        return self.accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def accept_rate_per_position(self) -> list[float]:
        """[i]: fraction of drafts whose first i+1 draft tokens were all accepted."""
        return [c / self.num_drafts if self.num_drafts else 0.0 for c in self.accept_counts]


@dataclass
class SpeculativeOutput:
    sequences: torch.Tensor  # (B, L + generated), padded like generate()'s
    stats: SpeculativeStats


@dataclass
class DecodeState:
    """Everything that changes between cycles."""

    cache: object  # the target's HF Cache
    slots: SlotBook  # token position of each target cache slot, per layer kind
    head_cache: HeadCache
    root: torch.Tensor  # (B,) last committed token, not yet in the target cache
    root_pos: torch.Tensor  # (B,) its position
    root_out: torch.Tensor  # (B, H) head output at the entry pairing the previous feature with root
    root_logits: torch.Tensor  # (B, V_draft)
    generated: list[list[int]]  # per row, committed new tokens
    finished: list[bool]


def speculative_generate(model, head, input_ids=None, attention_mask=None, *, tree: TreeConfig | None = None,
                         generation_config=None, return_dict_in_generate: bool | None = None, **kwargs):
    """Drop-in for ``model.generate(input_ids, ...)`` with EAGLE tree speculation (greedy).

    Returns the sequences tensor, or a ``SpeculativeOutput`` with ``.sequences`` and ``.stats`` when
    ``return_dict_in_generate=True``.
    """
    gen, _ = resolve_generation_config(model, generation_config, kwargs)
    if return_dict_in_generate is None:
        return_dict_in_generate = bool(gen.return_dict_in_generate)
    tree = tree if tree is not None else TreeConfig()
    if not isinstance(tree, TreeConfig):
        raise TypeError(f"tree must be a TreeConfig, got {type(tree).__name__}")
    input_ids, attention_mask = _check_inputs(input_ids, attention_mask)
    parts = resolve_target(model)
    _check_attention(model)
    head.attach(model)
    max_new = _max_new_tokens(gen, input_ids.shape[1])
    stats = SpeculativeStats(accept_counts=[0] * tree.depth)
    with torch.no_grad(), FeatureCapture(parts, head.feature_layers(parts.num_layers)) as cap:
        t0 = time.perf_counter()
        state = _prefill(model, head, cap, input_ids, attention_mask, gen, max_new)
        kinds = layer_kinds(state.cache, parts.text_config)
        stats.time_other += time.perf_counter() - t0
        while not all(state.finished):
            _cycle(model, head, cap, state, kinds, tree, gen, max_new, stats)
    sequences = _assemble(input_ids, state.generated, pad_id(gen))
    return SpeculativeOutput(sequences, stats) if return_dict_in_generate else sequences


def _check_inputs(input_ids, attention_mask):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a (batch, length) LongTensor, got {getattr(input_ids, 'shape', input_ids)!r}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: need at least one prompt token")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
    if bool((attention_mask[:, -1] == 0).any()):
        raise ValueError("right-padded batch: the last column of attention_mask has zeros; pad on the left "
                         "(tokenizer.padding_side = 'left')")
    return input_ids, attention_mask.to(input_ids.device)


def _check_attention(model) -> None:
    impl = getattr(model.config, "_attn_implementation", "eager")
    if impl not in ("eager", "sdpa"):
        raise ValueError(f"tree verification needs a 4D float mask, which attn_implementation={impl!r} cannot take; "
                         f"load the model with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))")


def _max_new_tokens(gen, prompt_len: int) -> int:
    if gen.max_new_tokens is not None:
        return int(gen.max_new_tokens)
    max_length = gen.max_length if gen.max_length is not None else 20  # generate()'s default
    return max(int(max_length) - prompt_len, 0)


def _prefill(model, head, cap, input_ids, attention_mask, gen, max_new) -> DecodeState:
    B = input_ids.shape[0]
    # Same positions as generate(): count real tokens; padding gets a dummy 1.
    pos = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=True)
    feats = cap.features()  # (B, L, F)
    root = out.logits[:, -1].argmax(-1)  # (B,)
    slot_pos = pos.masked_fill(attention_mask == 0, -1)
    head_tokens = torch.cat((input_ids[:, 1:], root[:, None]), 1)  # entry t pairs feature t with token t+1
    hcache, h_out, h_logits = extend_head(head, None, feats, head_tokens, slot_pos)
    state = DecodeState(
        cache=output_cache(out), slots=SlotBook.after_prefill(output_cache(out), slot_pos), head_cache=hcache, root=root, root_pos=pos[:, -1] + 1,
        root_out=h_out[:, -1], root_logits=h_logits[:, -1], generated=[[] for _ in range(B)], finished=[False] * B,
    )
    _commit(state, root[:, None].tolist(), eos_ids(gen), max_new)
    return state


def _commit(state: DecodeState, new_tokens: list[list[int]], eos: list[int], max_new: int) -> None:
    """Append each row's new tokens, stopping at eos (kept) or at max_new tokens, like generate()."""
    for b, toks in enumerate(new_tokens):
        if state.finished[b]:
            continue
        row = state.generated[b]
        for t in toks:
            if len(row) >= max_new:
                break
            row.append(t)
            if t in eos:
                break
        if len(row) >= max_new or (row and row[-1] in eos):
            state.finished[b] = True


def _cycle(model, head, cap, state: DecodeState, kinds, tree_cfg: TreeConfig, gen, max_new, stats) -> None:
    t0 = time.perf_counter()
    tree = draft_tree(head, state.head_cache, state.root, state.root_out, state.root_logits, state.root_pos, tree_cfg)
    t1 = time.perf_counter()

    # Verify: root + N nodes in one target forward with the tree mask.
    q_pos = state.root_pos[:, None] + tree.depth  # (B, N+1)
    masks = build_masks(kinds, state.slots, q_pos, ancestors(tree.parent, tree_cfg.depth), model.dtype)
    snap = CacheSnapshot(state.cache, tree.size)
    out = model(input_ids=tree.tokens, attention_mask=masks, position_ids=q_pos,
                **{cache_kwarg(model): state.cache}, use_cache=True)
    feats = cap.features()  # (B, N+1, F)
    target_next = out.logits.argmax(-1)  # (B, N+1) the target's choice after each node
    accept_len, best = greedy_accept(tree, target_next, tree_cfg.depth)
    path = path_indices(tree, best, tree_cfg.depth)  # (B, D+1)
    bonus = target_next.gather(1, best[:, None])  # (B, 1)
    # New tokens per row: path nodes 1..a, then the bonus at column a.
    j = torch.arange(tree_cfg.depth + 1, device=path.device)[None]
    path_next = torch.cat((tree.tokens.gather(1, path[:, 1:]), bonus), 1)  # (B, D+1)
    new_tok = torch.where(j == accept_len[:, None], bonus, path_next)
    # The one host sync of the cycle: accept lengths and new tokens.
    host = torch.cat((accept_len[:, None], new_tok), 1).cpu()
    t2 = time.perf_counter()

    acc = host[:, 0].tolist()
    active = [b for b, f in enumerate(state.finished) if not f]
    stats.num_target_forwards += 1
    stats.num_drafts += len(active)
    stats.num_draft_tokens += len(active) * (tree.size - 1)
    for b in active:
        stats.accepted_tokens += acc[b] + 1
        for i in range(acc[b]):
            stats.accept_counts[i] += 1
    _commit(state, [host[b, 1: acc[b] + 2].tolist() for b in range(len(acc))], eos_ids(gen), max_new)

    # Keep root + accepted nodes in the target cache (A slots for every row; shorter paths padded).
    A = max(acc) + 1
    keep = path[:, :A]  # (B, A)
    valid = j[:, :A] <= accept_len[:, None]  # (B, A)
    new_pos = torch.where(valid, q_pos.gather(1, keep), torch.full_like(keep, -1))
    keep_path(state.cache, snap, state.slots, keep, new_pos, tree.size)
    # Head: entries pairing each kept node's true feature with the next committed token.
    hidden = feats.gather(1, keep[:, :, None].expand(-1, -1, feats.shape[-1]))
    state.head_cache, h_out, h_logits = extend_head(head, state.head_cache, hidden, new_tok[:, :A], new_pos)
    last = accept_len[:, None]  # column of the bonus entry
    state.root_out = h_out.gather(1, last[:, :, None].expand(-1, -1, h_out.shape[-1])).squeeze(1)
    state.root_logits = h_logits.gather(1, last[:, :, None].expand(-1, -1, h_logits.shape[-1])).squeeze(1)
    state.root = bonus.squeeze(1)
    state.root_pos = state.root_pos + accept_len + 1
    t3 = time.perf_counter()
    stats.time_draft += t1 - t0
    stats.time_verify += t2 - t1
    stats.time_other += t3 - t2


def _assemble(input_ids: torch.Tensor, generated: list[list[int]], pad: int) -> torch.Tensor:
    width = max(len(g) for g in generated)
    out = torch.full((input_ids.shape[0], width), pad, dtype=input_ids.dtype)
    for b, g in enumerate(generated):
        out[b, : len(g)] = torch.tensor(g, dtype=input_ids.dtype)
    return torch.cat((input_ids, out.to(input_ids.device)), 1)
