"""The target's logits processors (HF's own, as ``generate`` builds them) applied at tree nodes.

The distribution after a tree node depends on the path to it, so processors that read ``input_ids``
(repetition penalty, n-gram bans, min length, ...) see the row's sequence plus the node's path.
Processors that ignore ``input_ids`` (temperature, top-k/p, min-p, ...) run once on all nodes.

``generate`` calls a processor with the whole batch, row b holding call row b's sequence: a processor may read the
row index (``prefix_allowed_tokens_fn``'s ``batch_id``, a custom processor that treats rows differently). Only
transformers' own processors, by exact type, are known to compute each row from its own sequence alone; they run
on a row's nodes as one batch. With any other processor the whole list runs as ``generate`` calls it: a batch of
the call's rows where row b holds one node of call row b, the others their own sequences (``_exact``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..hf.generation import INPUT_FREE, LENGTH_ONLY, ROW_WISE, for_row, min_length_rule

__all__ = ["CallRows", "process_tree_logits", "cycle_ops", "apply_ops", "apply_input_free", "reads_input_ids",
           "reads_tokens", "needs_call_batch", "node_paths"]


@dataclass
class CallRows:
    """What the processors read of the call's rows, as ``generate`` shows them.

    seqs[b]: call row b's sequence so far (1-D, the root included), or only its length (an int) when no processor
    reads the tokens (``reads_tokens``); None for a row no processor will see. slots[i]: the call row storage row i
    holds (``DecodeState.slots``). pad: the token ``generate`` appends to a finished row.
    """

    seqs: list
    slots: list[int]
    pad: int = 0

    def storage(self) -> list:
        """The storage rows' sequences (or lengths), in storage order."""
        return [self.seqs[b] for b in self.slots]


def _row_wise(p) -> bool:
    return type(p) in INPUT_FREE + LENGTH_ONLY + ROW_WISE


def needs_call_batch(processors) -> bool:
    """Whether some processor may read the row index or other rows: then every row's sequence is needed."""
    return not all(_row_wise(p) for p in (processors or []))


def _length_only(p, base: list[int], depth: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``p(seq, scores)`` for every node at once: eos masked below the minimum, as the processor does for one
    length. base: each row's sequence length (B ints); depth (B, N+1): a node's sequence is base + depth long;
    scores (B * (N+1), V)."""
    minimum, skip, eos_ids = min_length_rule(p)
    if min(base) - skip >= minimum:  # every node is past the minimum (decided on the host: no device work)
        return scores
    base_t = torch.tensor(base)
    if scores.is_cuda:  # from pinned memory the copy does not wait for the work queued on the GPU
        base_t = base_t.pin_memory()
    lengths = (base_t.to(scores.device, non_blocking=True)[:, None] + depth).flatten()  # (M,)
    short = (lengths - skip) < minimum  # (M,)
    return scores.masked_fill(short[:, None] & _eos_columns(scores, eos_ids)[None, :], float("-inf"))


def _eos_columns(scores: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """(V,) bool: the columns of scores (M, V) that are EOS ids (ids outside the vocabulary match none, as the
    processors' own ``isin`` has it)."""
    return torch.isin(torch.arange(scores.shape[-1], device=scores.device), eos_ids.to(scores.device))


def cycle_ops(processors, warpers, lengths, max_depth: int, device, eos: dict | None = None) -> tuple | None:
    """The call's processors as one cycle's captured acceptance applies them (``steps.accept_step``, ``apply_ops``), in
    their order: an input-free one as the sampler's own warper of that place (``warpers``: the decoder's sampler's, one
    object per setting, so that the captured step is kept between calls; () greedy), a length-only one as its EOS
    ids on ``device`` where it masks EOS at every node of the tree, and left out where it masks none. Whether it
    does is decided here, on the host, from ``lengths()`` (``DecodeState.lengths``: each storage row's sequence length;
    a node's is its row's plus its depth up to ``max_depth``), as ``_length_only`` decides per node. ``eos``: the
    call's {id(processor): its EOS ids on ``device``}, filled at first use (a copy to the GPU each cycle would wait
    for the verify queued before it). None where a processor reads the tokens, an input-free one has no warper
    (greedy), or a length-only one masks some nodes and not others: the cycle then runs ``process_tree_logits``."""
    ops, it, n = [], iter(warpers), None
    for p in processors or ():
        if type(p) in INPUT_FREE:
            w = next(it, None)
            if type(w) is not type(p):
                return None
            ops.append(w)
        elif type(p) in LENGTH_ONLY:
            minimum, skip, eos_ids = min_length_rule(p)
            n = lengths() if n is None else n
            if min(n) - skip >= minimum:  # every node is past the minimum
                continue
            if max(n) + max_depth - skip >= minimum:  # some nodes are, some not
                return None
            ids = None if eos is None else eos.get(id(p))
            if ids is None:
                ids = torch.as_tensor(eos_ids, device=device).flatten()
                if eos is not None:
                    eos[id(p)] = ids
            ops.append(ids)
        else:
            return None
    return tuple(ops)


def apply_ops(ops: tuple, scores: torch.Tensor) -> torch.Tensor:
    """``cycle_ops``'s ops on fp32 scores (M, V): a tensor of EOS ids masked to -inf as the length-only processors do
    below their minimum, anything else an input-free processor."""
    for op in ops:
        if isinstance(op, torch.Tensor):
            scores = scores.masked_fill(_eos_columns(scores, op), float("-inf"))
        else:
            scores = apply_input_free((op,), scores)
    return scores


def apply_input_free(processors, scores: torch.Tensor) -> torch.Tensor:
    """Input-free processors (``INPUT_FREE``) on scores (M, V), in order: what ``LogitsProcessorList`` does for
    them, without its signature inspection of every processor on every call (the decode cycle calls this each
    cycle, and the draft once per level)."""
    dummy = torch.zeros(scores.shape[0], 1, dtype=torch.long, device=scores.device)
    for p in processors:
        scores = p(dummy, scores)
    return scores


def reads_input_ids(processors) -> bool:
    """Whether any processor's output may depend on the sequence so far (or on anything but its scores row: a
    subclass of a warper may read the row index)."""
    return any(type(p) not in INPUT_FREE for p in (processors or []))


def reads_tokens(processors) -> bool:
    """Whether any processor reads the tokens so far, not only their number (what ``process_tree_logits`` then
    needs as each row's sequence; the others take each row's length)."""
    return any(type(p) not in INPUT_FREE + LENGTH_ONLY for p in (processors or []))


def node_paths(parent: torch.Tensor, depth: torch.Tensor, max_depth: int) -> torch.Tensor:
    """(B, N+1) tree -> (B, N+1, max_depth+1): [b, i, j] = the node at depth j on node i's path (j <= depth)."""
    B, n = parent.shape
    cols = [torch.arange(n, device=parent.device).expand(B, n)]
    for _ in range(max_depth):
        cols.append(parent.gather(1, cols[-1]))
    up = torch.stack(cols[::-1], dim=2)  # (B, N+1, D+1): column D - i holds the i-th ancestor
    j = torch.arange(max_depth + 1, device=parent.device)
    src = (max_depth - depth[:, :, None] + j).clamp(max=max_depth)
    return up.gather(2, src)


def process_tree_logits(processors, rows: CallRows, tree, logits: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Processed fp32 scores (B, N+1, V) of the target's logits at every tree node; ``rows``: the call's rows
    (``CallRows``), which the B storage rows hold (``rows.slots``)."""
    scores = logits.float()
    if not processors:
        return scores
    B, n, V = scores.shape
    if not reads_input_ids(processors):
        return apply_input_free(processors, scores.reshape(B * n, V)).reshape(B, n, V)
    if not reads_tokens(processors):
        # Lengths only: each node's sequence is its row's plus its depth; one batched call per processor.
        base = [r if isinstance(r, int) else r.numel() for r in rows.storage()]
        flat = scores.reshape(B * n, V)
        for p in processors:
            flat = _length_only(p, base, tree.depth, flat) if type(p) in LENGTH_ONLY else apply_input_free([p], flat)
        return flat.reshape(B, n, V)
    paths = tree.tokens.gather(1, node_paths(tree.parent, tree.depth, max_depth).flatten(1)).view(B, n, -1)
    depth = tree.depth.cpu()  # the slow paths group nodes by depth on the host
    if needs_call_batch(processors):
        return _exact(processors, rows, paths, depth, scores)
    out = torch.empty_like(scores)
    for i, (b, seq) in enumerate(zip(rows.slots, rows.storage())):
        row_processors = for_row(processors, b, len(rows.seqs))
        for d in range(int(depth[i].max()) + 1):
            nodes = (depth[i] == d).nonzero().flatten().to(scores.device)
            if nodes.numel() == 0:
                continue
            prefix = seq.to(scores.device).expand(nodes.numel(), -1)
            seqs = torch.cat((prefix, paths[i, nodes, 1: d + 1]), dim=1)  # (n_d, L_i + d)
            out[i, nodes] = row_processors(seqs, scores[i, nodes])
    return out


def _exact(processors, rows: CallRows, paths: torch.Tensor, depth: torch.Tensor, scores: torch.Tensor):
    """Every node through the processors as ``generate`` calls them: a (B_call, L) batch whose row b holds a node of
    call row b (its sequence, then the node's path), the other rows their own sequences cut or padded to L (as
    ``generate`` pads a finished row); only row b's output is kept. Nodes whose sequences are L long share calls,
    one node per call row in each. paths (B, N+1, D+1) node paths' tokens; depth (B, N+1) on the host."""
    groups: dict[int, list] = {}  # sequence length -> [(storage row, its nodes of that length)]
    for i, b in enumerate(rows.slots):
        for d in range(int(depth[i].max()) + 1):
            nodes = (depth[i] == d).nonzero().flatten().tolist()
            if nodes:
                groups.setdefault(rows.seqs[b].numel() + d, []).append((i, nodes))
    out = torch.empty_like(scores)
    for length, group in groups.items():
        base = _filler(rows, length, scores.device)  # (B_call, length)
        for r in range(max(len(nodes) for _, nodes in group)):
            seqs, batch_scores, placed = base.clone(), scores.new_zeros(base.shape[0], scores.shape[-1]), []
            for i, nodes in group:
                if r < len(nodes):
                    j, b = nodes[r], rows.slots[i]
                    start = rows.seqs[b].numel()
                    seqs[b, start:] = paths[i, j, 1: length - start + 1]
                    batch_scores[b] = scores[i, j]
                    placed.append((i, j, b))
            processed = processors(seqs, batch_scores)
            for i, j, b in placed:
                out[i, j] = processed[b]
    return out


def _filler(rows: CallRows, length: int, device) -> torch.Tensor:
    """(B_call, length): each call row's sequence, cut to ``length`` or padded after its end with ``rows.pad``."""
    out = torch.full((len(rows.seqs), length), rows.pad, dtype=torch.long)
    for b, seq in enumerate(rows.seqs):
        n = min(seq.numel(), length)
        out[b, :n] = seq[:n]
    return out.to(device)
