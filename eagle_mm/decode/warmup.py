"""Pay the first call's cost before it is felt: capture (or compile) the engine's steps for the shapes to come."""
from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)

__all__ = ["warmup"]


def warmup(model, head, *, batch_sizes=(1,), prompt_lengths=(64,), max_new_tokens: int = 64,
           do_sample: bool | tuple = (False, True), compile=None, tree=None, **generate_kwargs) -> float:
    """Run one short speculative_generate per (batch size, prompt length bucket, greedy/sampled) so that the
    engine's graphs for those shapes exist (CUDA graphs; with ``compile=True`` also inductor's kernels, which
    inductor caches on disk for later processes). Later calls with these shapes and the same ``max_new_tokens``
    or less start at once. Returns the seconds it took. Prompts are random token ids; the outputs are dropped.
    """
    from .loop import speculative_generate

    start = time.perf_counter()
    device = next(model.parameters()).device
    samples = do_sample if isinstance(do_sample, tuple) else (do_sample,)
    g = torch.Generator().manual_seed(0)
    vocab = min(model.config.get_text_config().vocab_size, 1000)
    for b in batch_sizes:
        for n in prompt_lengths:
            ids = torch.randint(3, vocab, (b, n), generator=g).to(device)
            for sample in samples:
                speculative_generate(model, head, ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=sample,
                                     compile=compile, tree=tree, **generate_kwargs)
    seconds = time.perf_counter() - start
    logger.info("warmed up %d shape(s) in %.1fs", len(batch_sizes) * len(prompt_lengths) * len(samples), seconds)
    return seconds
