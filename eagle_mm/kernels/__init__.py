"""Fused greedy tree verification: a Triton kernel, its pure-torch reference, and the dispatch between them.

The kernel module is imported lazily (by `dispatch`), so importing this package never imports Triton.
"""
from .dispatch import verify_greedy
from .reference import verify_greedy_reference

__all__ = ["verify_greedy", "verify_greedy_reference"]
