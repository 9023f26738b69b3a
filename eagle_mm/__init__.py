"""eagle_mm: drop-in EAGLE speculative-decoding draft heads for Hugging Face models."""
from .config import Eagle3Config, EagleConfig, TreeConfig
from .decode.decoder import Decoder, decoder, release
from .decode.loop import custom_generate, speculative_generate
from .heads import Eagle3Head, EagleHead
from .decode.state import SpeculativeOutput, SpeculativeStats
from .decode.warmup import warmup


def load_head(path, target=None, **kwargs):
    """Load an EAGLE or EAGLE-3 head (kind detected from the checkpoint)."""
    from .heads.io import load_head as _load

    return _load(path, target=target, **kwargs)


__all__ = [
    "EagleHead", "Eagle3Head", "EagleConfig", "Eagle3Config", "TreeConfig",
    "speculative_generate", "custom_generate", "decoder", "Decoder", "release", "SpeculativeOutput",
    "SpeculativeStats", "load_head", "warmup",
]
__version__ = "0.1.0"
