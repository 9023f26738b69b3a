"""Draft heads and their checkpoints.

Importing this package registers both head kinds and every on-disk layout (see heads/base.py).
"""
from . import engines, io, speculators  # noqa: F401  (each registers its layouts)
from .eagle import EagleHead
from .eagle3 import Eagle3Head

__all__ = ["EagleHead", "Eagle3Head"]
