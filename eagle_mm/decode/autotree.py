"""``tree="auto"``: the chooser's acceptance calibrated by replay on prompts, before it chooses.

The default call's chooser (``eagle_mm.decode.chooser``) learns the acceptance the head gets from the calls it
watches. ``tree="auto"`` gives it a head start on prompts like the ones to come: ``calibrate`` replays greedy
decoding on them, and ``calibrate_acceptance`` feeds what a few tree shapes would have accepted into the same
estimate (``acceptance.Acceptance``) the calls feed. ``choose_tree`` does all of it outside a call and returns
the chooser's decision (``chooser.TreeChoice``), whose ``.tree`` can be passed as ``tree=`` to later calls.

The replay. In greedy decoding the target's continuation of a prompt decides every acceptance: a draft node is
accepted iff its path spells the continuation. One greedy run of the target per calibration prompt and one head
pass give the head's state at every root position; drafting there once per top_k at the largest depth yields every
candidate with its score, and any smaller (depth, total) keeps a prefix of those candidates (levels are created in
order) reranked by ``select_tree`` exactly as ``draft_tree`` would. Walking the roots as the decode loop does (next
root = root + accepted + 1) visits exactly the cycles ``speculative_generate`` runs on these prompts, so the replayed
acceptance counts are its ``stats.accept_counts``. (Averaging over every root instead is biased: a cycle starts at
the bonus token, right after a rejection, so the loop's roots fall in step with the tokens the head gets wrong.)
For sampling the greedy replay is an approximation of the acceptance.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import TreeConfig
from ..hf.compat import cache_kwarg, output_cache
from ..hf.features import FeatureCapture
from ..hf.parts import resolve_target
from ..kernels.reference import greedy_accept
from .acceptance import Acceptance
from .draft import HeadCache, draft_candidates, head_cache, scratch_slots, with_scratch
from .tree import select_tree

logger = logging.getLogger(__name__)

__all__ = ["Replay", "calibrate", "calibrate_acceptance", "choose_tree", "TOP_KS", "REPLAYED"]

TOP_KS = (1, 2, 4, 8)  # top_k drafted at every root by default
# The shapes whose replayed acceptance feeds the chooser: a chain says how often the head's first choice is right,
# the trees of growing width how much its further choices add.
REPLAYED = (TreeConfig.chain(6), TreeConfig(6, 2, 12), TreeConfig(6, 4, 24), TreeConfig(6, 8, 48))


# ---- acceptance replay ----------------------------------------------------------------------------
@dataclass
class _Candidates:
    tokens: torch.Tensor  # (R, M) target ids, creation order: k at depth 1, then k*k per further level
    parent: torch.Tensor  # (R, M) candidate index of the parent, -1 = the root
    depth: torch.Tensor  # (M,)
    score: torch.Tensor  # (R, M) cumulative draft log-prob, what select_tree ranks by


def _draft_candidates(head, cache: HeadCache, root_out, root_logits, root_pos, top_k: int, depth: int) -> _Candidates:
    """``draft_tree``'s greedy candidates before its global rerank (on the host), so that one draft serves
    every total and every smaller depth."""
    c = draft_candidates(head, with_scratch(cache, scratch_slots(top_k, depth)), root_out, root_logits, root_pos,
                         top_k, depth)
    return _Candidates(c.tokens.cpu(), c.parent.cpu(), c.depth.cpu(), c.score.cpu())


@dataclass
class Replay:
    """Every root position the decode loop can visit on the calibration prompts (rows, prompt after prompt):
    the target's greedy continuation after it and the head's draft candidates there, per top_k."""

    root: torch.Tensor  # (R,) root token of each row
    ahead: torch.Tensor  # (R, D+1) [r, d]: the target's greedy token after row r's right node at depth d
    candidates: dict[int, _Candidates]
    spans: list[tuple[int, int, int]]  # per prompt: (first row, prompt length, max_new_tokens)
    max_depth: int

    def accept_lengths(self, tree: TreeConfig) -> torch.Tensor:
        """(R,) draft tokens greedy verification accepts at each row's root with this tree."""
        if tree.top_k not in self.candidates or tree.depth > self.max_depth:
            raise ValueError(f"{tree} was not calibrated: top_k in {sorted(self.candidates)}, "
                             f"depth <= {self.max_depth}")
        c, k = self.candidates[tree.top_k], tree.top_k
        m = k + (tree.depth - 1) * k * k  # the candidates of levels 1..depth
        drafted = select_tree(self.root, c.tokens[:, :m], c.parent[:, :m], c.depth[:m], c.score[:, :m],
                              tree.total_tokens)
        target = self.ahead.gather(1, drafted.depth)  # (R, N+1); only nodes on the right path matter
        return greedy_accept(drafted.tokens, drafted.parent, drafted.depth, target, tree.depth)[0]

    def cycles(self, tree: TreeConfig) -> list[int]:
        """Draft tokens accepted in each cycle ``speculative_generate`` runs on the prompts, prompt after prompt."""
        acc = self.accept_lengths(tree).tolist()
        out = []
        for first, _, max_new in self.spans:
            done, p = 1, 0  # the prefill commits the first token
            while done < max_new:
                out.append(acc[first + p])
                done, p = done + acc[first + p] + 1, p + acc[first + p] + 1
        return out

    def mean_accept_length(self, tree: TreeConfig) -> float:
        """Tokens per cycle (bonus included) over the cycles ``speculative_generate`` runs on each prompt."""
        cycles = self.cycles(tree)
        return sum(a + 1 for a in cycles) / len(cycles)

    def counts(self, tree: TreeConfig) -> tuple[int, list[int]]:
        """(cycles, [cycles whose accepted length >= i + 1]): what ``stats`` would count for these prompts."""
        cycles = self.cycles(tree)
        return len(cycles), [sum(a > i for a in cycles) for i in range(tree.depth)]


def _prompt_rows(prompts, device) -> list[torch.Tensor]:
    """A (B, L) tensor or a list of (L,)/(1, L) tensors -> list of (1, L) long tensors on ``device``."""
    rows = list(prompts) if not isinstance(prompts, torch.Tensor) else list(prompts.view(-1, prompts.shape[-1]))
    rows = [torch.as_tensor(r).reshape(1, -1).long().to(device) for r in rows]
    if not rows or any(r.shape[1] == 0 for r in rows):
        raise ValueError("calibration needs at least one non-empty prompt")
    return rows


def _greedy_run(model, cap: FeatureCapture, ids: torch.Tensor, n: int):
    """The target's greedy continuation: (1, L+n) tokens and the captured features of the first L+n-1."""
    L, dev = ids.shape[1], ids.device
    out = model(input_ids=ids, position_ids=torch.arange(L, device=dev)[None], use_cache=True)
    feats, seq = [cap.features()], [ids]
    for i in range(n):
        tok = out.logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        seq.append(tok)
        if i < n - 1:
            out = model(input_ids=tok, position_ids=torch.full_like(tok, L + i), use_cache=True,
                        **{cache_kwarg(model): output_cache(out)})
            feats.append(cap.features())
    return torch.cat(seq, 1), torch.cat(feats, 1)


@torch.no_grad()
def calibrate(model, head, prompts, *, top_ks=TOP_KS, max_depth: int = 8, max_new_tokens: int = 48,
              rows_per_batch: int = 64) -> Replay:
    """Run the target greedily for ``max_new_tokens`` (+ ``max_depth``) tokens after each prompt and draft at
    every root position the decode loop can reach, once per top_k at ``max_depth`` levels."""
    if max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be >= 2 (the first token needs no draft), got {max_new_tokens}")
    parts = resolve_target(model)
    head.attach(model)
    vd = getattr(head.config, "draft_vocab_size", None) or head.config.vocab_size
    if max(top_ks) > vd:
        raise ValueError(f"top_k={max(top_ks)} exceeds the head's draft vocabulary of {vd} tokens")
    rows = _prompt_rows(prompts, next(model.parameters()).device)
    with FeatureCapture(parts, head.feature_layers(parts.num_layers)) as cap:
        runs = [_greedy_run(model, cap, ids, max_new_tokens + max_depth) for ids in rows]
    roots, aheads, spans, cands = [], [], [], {k: [] for k in top_ks}
    for ids, (seq, feats) in zip(rows, runs):
        T, dev = seq.shape[1], seq.device
        hcache, h_out, h_logits = head_cache(head, feats, seq[:, 1:], torch.arange(T - 1, device=dev)[None])
        at = torch.arange(ids.shape[1], ids.shape[1] + max_new_tokens - 1, device=dev)  # reachable roots
        spans.append((sum(r.numel() for r in roots), ids.shape[1], max_new_tokens))
        roots.append(seq[0, at].cpu())
        aheads.append(seq[0, at[:, None] + torch.arange(1, max_depth + 2, device=dev)].cpu())
        for q in at.split(rows_per_batch):
            R, S = q.numel(), int(q[-1])  # entries 0..q-1 exist when the root is at position q
            ent = torch.arange(S, device=dev)[None]
            cache = HeadCache(hcache.k[:, :, :S].expand(R, -1, -1, -1), hcache.v[:, :, :S].expand(R, -1, -1, -1),
                              torch.where(ent < q[:, None], ent, -1))
            for k in top_ks:
                cands[k].append(_draft_candidates(head, cache, h_out[0, q - 1], h_logits[0, q - 1], q, k, max_depth))
    joined = {k: _Candidates(torch.cat([c.tokens for c in cs]), torch.cat([c.parent for c in cs]), cs[0].depth,
                             torch.cat([c.score for c in cs])) for k, cs in cands.items()}
    return Replay(torch.cat(roots), torch.cat(aheads), joined, spans, max_depth)


# ---- feeding the chooser ---------------------------------------------------------------------------
def calibrate_acceptance(model, head, prompts, acceptance: Acceptance, *, trees=REPLAYED,
                         max_new_tokens: int = 48) -> Replay:
    """``calibrate`` on ``prompts``, then what each of ``trees`` accepted there, observed by ``acceptance``."""
    vd = getattr(head.config, "draft_vocab_size", None) or head.config.vocab_size
    trees = [t for t in trees if t.drafts and t.top_k <= vd]
    replay = calibrate(model, head, prompts, top_ks=sorted({t.top_k for t in trees}),
                       max_depth=max(t.depth for t in trees), max_new_tokens=max_new_tokens)
    for tree in trees:
        acceptance.observe(tree, *replay.counts(tree))
    logger.info("tree='auto': replayed acceptance %s; fitted (a, t, c) = %s",
                {str(t): round(replay.mean_accept_length(t), 2) for t in trees}, acceptance.fit())
    return replay


def choose_tree(model, head, prompts, *, decode, batch_size: int = 1, do_sample: bool = False, **generate_kwargs):
    """The chooser's decision for ``batch_size`` rows like ``prompts`` on this machine (``chooser.TreeChoice``: its
    ``.tree``, ``.finalists`` with their expected rates), its acceptance calibrated on ``prompts`` by replay: what
    ``tree="auto"`` decides. It decodes 8 tokens of the first prompt through ``decode``
    (``eagle_mm.speculative_generate``, passed in: the loop imports this module), where the costs are measured.
    Pass the ``.tree`` as ``tree=`` to decode many prompts with it."""
    rows = _prompt_rows(prompts, next(model.parameters()).device)
    ids = rows[0].expand(batch_size, -1).contiguous()
    out = decode(model, head, ids, max_new_tokens=8, min_new_tokens=8, do_sample=do_sample, tree="auto",
                 autotree_inputs=rows, return_dict_in_generate=True, **generate_kwargs)
    return out.stats.choices[0]
