"""accelerate's process-wide state, where the training code must look into it."""
from __future__ import annotations

__all__ = ["drop_other_precision"]


def drop_other_precision(mixed_precision: str) -> None:
    """Forget the mixed precision an earlier ``Accelerator`` in this process fixed, if it differs from
    ``mixed_precision`` (the process group stays), so that a new one can pick its own."""
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision", mixed_precision) != mixed_precision:
        AcceleratorState._reset_state()
