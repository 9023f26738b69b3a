"""The prefill: the prompt's forward into the decoder's storage, the first token as ``generate`` picks it, and the
head's entries for the prompt (the features the forward captured, shifted one token), before the first cycle."""
from __future__ import annotations

import time

import torch

from ..hf.multimodal import hide_image_features, rope_offsets
from .draft import head_entries
from .runner import step_mode
from .state import Call, DecodeState
from .storage import prefill_length

__all__ = ["prefill"]


def _prompt_forward(call: Call, input_ids, slot_pos, position_ids, images):
    """The prompt's forward into slots [0, T'). Returns (logits (B, V) after the last token, features (B, T', F),
    input ids (B, T'), slot positions (B, T')); T' = ``prefill_length(T)`` for text prompts whose prefill is
    captured (left-padded with empty slots), else T (eager; a vision-language prompt: run by the model's own forward,
    with its images, token types and M-RoPE positions)."""
    store = call.dec.storage
    if images is not None:  # the vision tower, the merged embeddings, its image masks: the model's own forward
        model_pos = images.positions if images.positions is not None else position_ids
        out = call.model(input_ids=input_ids, attention_mask=(slot_pos >= 0).long(), position_ids=model_pos,
                         **images.inputs, **{store.kwarg: store.cache}, use_cache=True, logits_to_keep=1)
        store.positions(slot_pos)
        return out.logits[:, -1], call.cap.features(), input_ids, slot_pos
    B, T = input_ids.shape
    # Bucketing pads a prompt so that nearby lengths replay one captured prefill: eagerly, padding only costs.
    pad = prefill_length(T) - T if step_mode("prefill", call.dec.runner.mode) == "graphs" else 0
    if pad:
        input_ids = torch.cat((input_ids.new_zeros(B, pad), input_ids), 1)
        slot_pos = torch.cat((slot_pos.new_full((B, pad), -1), slot_pos), 1)
        position_ids = torch.cat((position_ids.new_zeros(B, pad), position_ids), 1)
    store.positions(slot_pos)
    write = torch.arange(T + pad, device=input_ids.device)
    # Also allocates a new cache's layers, before any compiled step.
    logits, feats = call.dec.runner.prefill(call.model, store.in_use(T + pad), call.cap, input_ids, slot_pos, write,
                                            position_ids)
    return logits[:, -1], feats, input_ids, slot_pos


def prefill(call: Call, input_ids, mask, position_ids, images) -> DecodeState:
    """The prompt's forward, the first token, and the head's entries for the prompt, into the decoder's buffers.
    Returns the call's host state, the first token (``state.first``) not yet committed."""
    head, gen, cap = call.head, call.gen, call.cap
    slot_pos = position_ids.masked_fill(mask == 0, -1)  # (B, T)
    last_logits, feats, ids, slot_pos = _prompt_forward(call, input_ids, slot_pos, position_ids, images)  # T' >= T
    if head.hides_image_features(cap.parts):  # the stricter image ablation: zeros at the image positions
        feats = hide_image_features(feats, ids, cap.parts.image_token_id)
    scores = last_logits.float()
    if call.processors:
        scores = call.processors(input_ids, scores)
    root = _choose(scores, gen.do_sample, call.generator)  # (B,)
    _start_head(call, feats, ids, slot_pos, root, position_ids[:, -1] + 1)
    B = input_ids.shape[0]
    state = DecodeState(prompt=input_ids.tolist(), generated=[[] for _ in range(B)], finished=[False] * B,
                        first=root.cpu(), rope_offsets=rope_offsets(images, position_ids) if images is not None
                        else None, logits=[[r] for r in last_logits.float().cpu()] if gen.output_logits else None,
                        scores=[[r] for r in scores.cpu()] if gen.output_scores else None)
    return state


def _start_head(call: Call, feats, ids, slot_pos, root, root_pos) -> None:
    """The head's entries for the prompt (features (B, T', F) at slots slot_pos (B, T') of tokens ids) and the root
    (B,) at root_pos (B,), into the decoder's buffers. A call that starts without a tree never drafts
    (``session.Session``): the head's pass over the prompt is skipped, its entries left empty (positions -1)."""
    head, cap = call.head, call.cap
    if not call.dec.tree.drafts:
        c, B, S = head.config, *slot_pos.shape
        k = torch.zeros(B, c.num_key_value_heads, S, c.head_dim, dtype=next(head.parameters()).dtype,
                        device=slot_pos.device)
        vocab = getattr(c, "draft_vocab_size", None) or c.vocab_size
        call.dec.start(k, torch.zeros_like(k), torch.full_like(slot_pos, -1), root, root_pos,
                       k.new_zeros(B, c.hidden_size), torch.zeros(B, vocab, device=slot_pos.device))
        return
    head_tokens = torch.cat((ids[:, 1:], root[:, None]), 1)  # entry t pairs feature t with token t+1
    embeds = None
    if cap.keeps_input_embeds:
        # The target's merged embeddings (image features at image positions), shifted like head_tokens.
        embeds = torch.cat((cap.input_embeds()[:, 1:], head.embed(root[:, None]).to(feats.device)), 1)
    t0 = time.perf_counter()
    h_out, h_logits, (k, v) = head_entries(head, None, feats, head_tokens, slot_pos, embeds=embeds)
    call.dec.start(k, v, slot_pos, root, root_pos, h_out[:, -1], h_logits[:, -1])
    if call.session is not None:  # what drafting costs the call before its first cycle
        call.session.prompt_seconds = time.perf_counter() - t0


def _choose(scores: torch.Tensor, do_sample: bool, generator) -> torch.Tensor:
    """Next token from processed scores (B, V), as generate() picks it."""
    if not do_sample:
        return scores.argmax(-1)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
