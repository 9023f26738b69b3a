"""Tree verification kernels (greedy and sampling): Triton, their pure-torch references, and the dispatch.

The kernel modules are imported lazily (by `dispatch`), so importing this package never imports Triton.
"""
from .dispatch import verify_greedy, verify_sampling
from .reference import verify_greedy_reference

__all__ = ["verify_greedy", "verify_greedy_reference", "verify_sampling"]
