"""The command line (eagle-mm), the demo and the benchmark."""
from .main import main

__all__ = ["main"]
