"""`make_accelerator`: the one place the training code builds an accelerate ``Accelerator``."""
from __future__ import annotations

import os

import torch

from ..hf.accelerate import drop_other_precision

__all__ = ["make_accelerator"]


def make_accelerator(mixed_precision: str = "no"):
    """An Accelerator; processes started by a launcher on a machine without GPUs join over gloo.

    (accelerate picks its CPU backend only when asked, and would otherwise let each process train alone.)
    """
    from accelerate import Accelerator

    drop_other_precision(mixed_precision)  # an earlier train() call in this process may have fixed another
    world = int(os.environ.get("WORLD_SIZE", "1"))
    acc = Accelerator(mixed_precision=mixed_precision, cpu=world > 1 and not torch.cuda.is_available())
    if acc.num_processes != world:
        raise RuntimeError(f"launched as {world} processes but accelerate set up {acc.num_processes} "
                           f"({acc.distributed_type}); check the launcher's configuration")
    return acc
