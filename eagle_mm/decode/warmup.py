"""Pay the first call's cost before it is felt: capture (or compile) the engine's steps for the shapes to come."""
from __future__ import annotations

import logging
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

logger = logging.getLogger(__name__)

__all__ = ["warmup"]


def warmup(model, head, *, batch_sizes=(1,), prompt_lengths=(64,), max_new_tokens: int = 64,
           do_sample: bool | tuple = (False, True), compile=None, tree=None, **generate_kwargs) -> float:
    """Run one short speculative_generate per (batch size, prompt length bucket, greedy/sampled) so that the
    engine's graphs for those shapes exist (CUDA graphs; with ``compile=True`` also inductor's kernels, which
    inductor caches on disk for later processes). Without ``compile``, a batch of several rows runs a second call
    whose rows stop one after another: rows that finish leave the engine's batch (in powers of two with CUDA
    graphs), and each smaller batch has graphs of its own, which a later call would otherwise capture when its
    rows first shrink to it. Later calls with these shapes and the same ``max_new_tokens`` start at once (the
    engine's cache grows to what these calls reach and is kept; a call that can use fewer slots than the kept cache
    holds allocates its own, and captures its graphs once). Returns the seconds it took. Prompts are random token
    ids; the outputs are dropped.
    """
    from .loop import speculative_generate

    start = time.perf_counter()
    device = next(model.parameters()).device
    samples = do_sample if isinstance(do_sample, tuple) else (do_sample,)
    g = torch.Generator().manual_seed(0)
    vocab = min(model.config.get_text_config().vocab_size, 1000)
    calls = 0
    for b in batch_sizes:
        for n in prompt_lengths:
            ids = torch.randint(3, vocab, (b, n), generator=g).to(device)
            for sample in samples:
                # Compiled steps keep their batch (a new size would be a new compile): nothing smaller to warm.
                for staggered in (False, True) if b > 1 and compile in (None, False) else (False,):
                    kw = dict(generate_kwargs)
                    if staggered:
                        kw["stopping_criteria"] = StoppingCriteriaList([*kw.get("stopping_criteria", ()),
                                                                        _Staggered(ids, max_new_tokens)])
                    speculative_generate(model, head, ids, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                         do_sample=sample, compile=compile, tree=tree, **kw)
                    calls += 1
    seconds = time.perf_counter() - start
    logger.info("warmed up %d shape(s) in %d calls, %.1fs", len(batch_sizes) * len(prompt_lengths) * len(samples),
                calls, seconds)
    return seconds


class _Staggered(StoppingCriteria):
    """Stops row i of ``prompts`` (B, T) after about (i+1)/B of ``new`` tokens, the last row at the end: each row
    is told apart by its prompt (the prefix a criterion sees), so the batch shrinks step by step to one row."""

    def __init__(self, prompts: torch.Tensor, new: int):
        self.rows = [p.tolist() for p in prompts.cpu()]
        self.start, B = prompts.shape[1], prompts.shape[0]
        self.stop_at = [max(1, (i + 1) * new // B) for i in range(B)]  # new tokens each row keeps

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        done = []
        for seq in input_ids:
            row = self.rows.index(seq[: self.start].tolist())  # prompts differ (random ids), so this is the row
            done.append(seq.shape[0] - self.start >= self.stop_at[row])
        return torch.tensor(done, device=input_ids.device)
