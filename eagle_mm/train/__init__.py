"""Training of EAGLE-1 and EAGLE-3 draft heads (see docs/training.md).

``train(TrainConfig(...))`` trains and writes a head that ``from_pretrained`` loads; ``dump_features`` runs
the target once and writes its features for ``TrainConfig(features_dir=...)``.
"""
from .config import TrainConfig
from .dump import FeatureStore, dump_features
from .loop import TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train", "dump_features", "FeatureStore"]
