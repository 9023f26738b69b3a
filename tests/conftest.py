"""Shared test setup: tests build tiny models on CPU; keep them from oversubscribing the 2 cores."""

import os

# Triton kernels run on CPU tensors through the interpreter; it must be chosen before triton is first
# imported anywhere in the process, so it is set here rather than in the kernel test module.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

# One thread: these models are tiny, and two threads on two shared cores thrash (7x slower measured).
torch.set_num_threads(1)
