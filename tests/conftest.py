"""Shared test setup: tests build tiny models on CPU; keep them from oversubscribing the 2 cores."""

import torch

torch.set_num_threads(2)
