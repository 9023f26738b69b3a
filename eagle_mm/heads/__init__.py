from .eagle import EagleHead
from .eagle3 import Eagle3Head

__all__ = ["EagleHead", "Eagle3Head"]
