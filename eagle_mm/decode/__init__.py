"""The decode cycle: prefill -> draft -> verify -> accept -> update (``loop.py``), its storages and its pieces."""
