"""Writing a draft head in the layout an engine loads, and the command that serves it (``eagle-mm export`` is its
command line, in ``eagle_mm/cli/export.py``).

The layouts themselves live beside the reader in eagle_mm/heads/ (engines.py: vLLM and SGLang,
speculators.py: vLLM's speculators format); their public names are importable from here.
"""
from __future__ import annotations

from .heads.engines import LAYOUTS, detect_layout, export_head, export_notes, load_exported, serving_command

__all__ = ["LAYOUTS", "export_head", "load_exported", "detect_layout", "serving_command", "export_notes"]
