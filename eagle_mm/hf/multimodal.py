"""Vision-language targets: the image inputs of the prefill, their checks, and M-RoPE positions.

Images are encoded once, by the target's own prefill forward, which merges the image features into the
input embeddings at the image-token positions. The loop reads the merged embeddings back as the input of
decoder layer 0 (``FeatureCapture(..., input_embeds=True)``) and feeds them to the draft head, so at an
image position the head sees the image feature, not the embedding of the placeholder token. Every later
target forward is text only: the images live on in the KV cache.

Qwen2.5-VL and Qwen3-VL positions are 3D (temporal, height, width). generate() prepares the prompt's from
the image grids; after the prompt all three axes advance with the text position, each from where the prompt
left it: ``text position + offset``, the offset per row and axis (the model's ``rope_deltas`` whenever the
prompt ends with text, as chat prompts do). Qwen3-VL's interleaved M-RoPE changes which rotary frequencies
read which axis, not the position ids, so the same rule holds. The draft head keeps plain 1D positions (its
own RoPE).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .parts import TargetParts

__all__ = ["PREFILL_INPUTS", "ImagePrompt", "image_prompt", "check_images", "hide_image_features", "rope_offsets",
           "verify_positions"]

# Model inputs that carry images or per-token image facts: they go to the prefill forward only.
# ``position_ids`` is accepted so M-RoPE targets keep generate()'s 3D prompt positions.
PREFILL_INPUTS = ("pixel_values", "image_grid_thw", "image_sizes", "mm_encoder_outputs", "mm_token_type_ids",
                  "token_type_ids", "vision_feature_layer", "vision_feature_select_strategy", "position_ids")


@dataclass
class ImagePrompt:
    """What the prefill forward gets beyond input ids, mask and positions."""

    inputs: dict  # images (pixel values or generate()'s pre-encoded ones) and token types
    positions: torch.Tensor | None  # (R, B, T) M-RoPE prompt positions as generate() made them, else None

    @property
    def num_images(self) -> int:
        """Images (or image tiles, where the family tiles them) in the prompt: 0 for a text-only prompt."""
        encoded = (self.inputs.get("mm_encoder_outputs") or {}).get("image")
        if encoded is not None:
            return len(_encoded_counts(encoded))
        return _count_images(self.inputs) if self.inputs.get("pixel_values") is not None else 0


def image_prompt(parts: TargetParts, config, input_ids: torch.Tensor, extra: dict) -> ImagePrompt:
    """Collect the prefill-only inputs from what generate() prepared, after checking them against the prompt."""
    inputs = dict(extra)
    positions = inputs.pop("position_ids", None)
    others = sorted(set(inputs.get("mm_encoder_outputs") or {}) - {"image"})
    if others:
        raise ValueError(f"speculative_generate supports image inputs only, got encoded {others} inputs too")
    if parts.rope == "mrope" and positions is None:
        raise ValueError(f"{parts.model_type} uses 3D (M-RoPE) positions: call it through speculative_generate or "
                         f"model.generate(custom_generate=...), which prepare them")
    check_images(parts, config, input_ids, inputs)
    return ImagePrompt(inputs=inputs, positions=positions)


def check_images(parts: TargetParts, config, input_ids: torch.Tensor, inputs: dict) -> None:
    """Check the prompt's image tokens against the images in ``inputs`` (pixels or encoded): a ValueError naming
    the counts where they do not fit.

    speculative_generate runs it on the caller's inputs, before generate() (whose own preparation can fail
    obscurely on a mismatch); the loop runs it again on what generate() prepared.
    """
    per_image = _features_per_image(parts.model_type, config, inputs)
    token = parts.image_token_id
    n_tokens = int((input_ids == token).sum()) if token is not None else 0
    n_images = len(per_image) if per_image is not None else _count_images(inputs)
    if n_tokens and not n_images:
        raise ValueError(f"input_ids hold {n_tokens} image tokens (id {token}) but no images were given: pass "
                         f"pixel_values (and the processor's other image outputs) with them")
    if n_images and not n_tokens:
        raise ValueError(f"{n_images} image(s) were given but input_ids hold no image tokens (id {token}); put each "
                         f"image's placeholder in the prompt, expanded to its feature count")
    if per_image is not None and n_tokens != sum(per_image):
        raise ValueError(f"input_ids hold {n_tokens} image tokens (id {token}) but the {n_images} image(s) give "
                         f"{sum(per_image)} image features ({per_image} per image): each image's placeholder must be "
                         f"expanded to exactly its feature count")


def hide_image_features(features: torch.Tensor, input_ids: torch.Tensor, image_token_id: int | None) -> torch.Tensor:
    """``features`` (B, T, F), aligned with ``input_ids`` (B, T), with zeros at the image placeholder positions:
    what a head with ``image_features=False`` reads (the same in training and decoding)."""
    if image_token_id is None:
        raise ValueError("image_features=False needs a vision-language target with an image token id; this target "
                         "has none")
    if features.shape[:2] != input_ids.shape:
        raise ValueError(f"features {tuple(features.shape)} do not align with input_ids {tuple(input_ids.shape)}")
    return features.masked_fill((input_ids == image_token_id).unsqueeze(-1).to(features.device), 0)


def rope_offsets(prompt: ImagePrompt, text_pos: torch.Tensor) -> torch.Tensor | None:
    """(3, B) offset of each M-RoPE axis from the text position at the prompt's last token; None for 1D RoPE.

    text_pos (B, T) the prompt's text positions. generate() continues every axis by +1 per token from the
    prompt's last position, which is what ``text position + offset`` reproduces for any later token.
    """
    if prompt.positions is None:
        return None
    axes = prompt.positions[-3:]  # (3, B, T): drop generate()'s leading text row when it has one
    return axes[:, :, -1] - text_pos[None, :, -1].to(axes.device)


def verify_positions(q_pos: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """Target position ids for new tokens at text positions q_pos (B, Q): (B, Q), or (3, B, Q) under M-RoPE."""
    if offsets is None:
        return q_pos
    return q_pos[None] + offsets[:, :, None]


def _count_images(inputs: dict) -> int:
    """Images given as pixels, where their feature counts are not known beforehand."""
    grid = inputs.get("image_grid_thw")
    return int(grid.shape[0]) if grid is not None else int(inputs["pixel_values"].shape[0])


def _features_per_image(model_type: str, config, inputs: dict) -> list[int] | None:
    """Image features the target will merge, per image (or tile); None where that is not known beforehand."""
    encoded = (inputs.get("mm_encoder_outputs") or {}).get("image")
    if encoded is not None:  # transformers >= 5.24 encodes the images inside generate(), before our loop
        return _encoded_counts(encoded)
    if inputs.get("pixel_values") is None:
        return []
    rule = _PIXEL_RULES.get(model_type)
    return None if rule is None else rule(config, inputs)


def _encoded_counts(encoded) -> list[int]:
    """Per-image feature counts of a vision encoder output (pooled features where the family pools)."""
    out = getattr(encoded, "pooler_output", None)
    if out is None:
        out = encoded.last_hidden_state
    if isinstance(out, (list, tuple)):
        return [t.numel() // t.shape[-1] for t in out]
    return [out.shape[1]] * out.shape[0] if out.dim() == 3 else [out.shape[0]]


def _grid_tokens(config, pixels: torch.Tensor) -> int:
    patch = config.vision_config.patch_size
    return (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)


def _llava(config, inputs) -> list[int] | None:
    if config.vision_config.model_type != "clip_vision_model":
        return None  # other towers differ in their class token; the target checks the count itself
    pixels = inputs["pixel_values"]
    strategy = inputs.get("vision_feature_select_strategy") or config.vision_feature_select_strategy
    return [_grid_tokens(config, pixels) + (strategy == "full")] * pixels.shape[0]


def _qwen_vl(config, inputs) -> list[int] | None:
    grid = inputs.get("image_grid_thw")
    if grid is None:
        return None
    return (grid.prod(-1) // config.vision_config.spatial_merge_size ** 2).tolist()


def _gemma3(config, inputs) -> list[int]:
    return [config.mm_tokens_per_image] * inputs["pixel_values"].shape[0]


def _llama4(config, inputs) -> list[int]:
    pixels = inputs["pixel_values"]  # (tiles, C, H, W); the pixel shuffle merges ratio^-2 patches into one
    return [int(_grid_tokens(config, pixels) * config.vision_config.pixel_shuffle_ratio ** 2)] * pixels.shape[0]


# model_type -> image features per image, from the raw pixel inputs (transformers < 5.24 hands us those).
_PIXEL_RULES = {"llava": _llava, "qwen2_5_vl": _qwen_vl, "qwen3_vl": _qwen_vl, "qwen3_vl_moe": _qwen_vl,
                "gemma3": _gemma3, "llama4": _llama4}
