"""The decode loop's per-call state, and what speculative_generate returns with ``return_dict_in_generate=True``."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ..config import TreeConfig

__all__ = ["DecodeState", "SpeculativeOutput", "SpeculativeStats"]


@dataclass
class DecodeState:
    """What the host keeps per row; the device side lives in the storage (``fixed``/``dynamic``)."""

    prompt: list[list[int]]  # per row, the (padded) prompt as generate() sees it
    generated: list[list[int]]  # per row, committed new tokens
    finished: list[bool]
    first: torch.Tensor  # (B,) the prefill's token, on the host
    rope_offsets: torch.Tensor | None  # (3, B') M-RoPE offset of each axis from the text position (storage rows)
    # output_logits / output_scores: per row, the target's raw / processed (V,) rows behind each committed token
    logits: list[list[torch.Tensor]] | None = None
    scores: list[list[torch.Tensor]] | None = None
    slots: list[int] = field(default_factory=list)  # [i]: the row in the storage's row i (fewer once rows finish)

    def __post_init__(self):
        if not self.slots:
            self.slots = list(range(len(self.prompt)))

    def row(self, b: int) -> torch.Tensor:
        return torch.tensor(self.prompt[b] + self.generated[b], dtype=torch.long)

    def keep(self, keep: list[int]) -> None:
        """The storage went on with its rows ``keep`` (``rows.plan``), in that order."""
        self.slots = [self.slots[i] for i in keep]
        if self.rope_offsets is not None:
            self.rope_offsets = self.rope_offsets[:, keep]


@dataclass
class SpeculativeStats:
    """Acceptance statistics of one call; acceptance counts are before any stopping truncation."""

    num_target_forwards: int = 0  # verify forwards (the prefill is not counted)
    num_drafts: int = 0  # (row, cycle) pairs drafted
    num_draft_tokens: int = 0  # draft nodes sent to verification, over all rows
    accept_counts: list[int] = field(default_factory=list)  # [i]: drafts whose accepted length >= i+1
    accepted_tokens: int = 0  # tokens gained from verify forwards (accepted + bonus)
    time_draft: float = 0.0  # seconds growing trees (head forwards)
    time_verify: float = 0.0  # seconds in target verify forwards and acceptance
    time_other: float = 0.0  # per-cycle bookkeeping (committing tokens, stopping checks, the dynamic cache/head update)
    time_prefill: float = 0.0  # seconds from the call's start to its first token: prefill forward and setup
    time_compile: float = 0.0  # seconds of the above spent compiling or capturing graphs (first calls of a shape)
    tree: TreeConfig | None = None  # the draft tree the loop started with (``TreeConfig.none()``: no draft)
    # The chooser's decisions (``chooser.TreeChoice``: the tree, the batch, why, the finalists' expected rates), the
    # first at the start and one whenever it picked again; empty when the call was given a tree.
    choices: list = field(default_factory=list)
    engine: str = "fixed"  # "fixed": the engine's buffers; "dynamic": the fallback over HF's DynamicCache
    mode: str | None = None  # the engine's step mode: None eager, "graphs", or a torch.compile mode

    @property
    def mean_accept_length(self) -> float:
        """Tokens per target forward and row, the bonus token included."""
        return self.accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def accept_rate_per_position(self) -> list[float]:
        """[i]: fraction of drafts whose first i+1 draft tokens were all accepted (vLLM's "acceptance at token i")."""
        return [c / self.num_drafts if self.num_drafts else 0.0 for c in self.accept_counts]

    @property
    def wall_time(self) -> float:
        return self.time_prefill + self.time_draft + self.time_verify + self.time_other

    def as_dict(self) -> dict:
        return {
            "mean_accept_length": self.mean_accept_length,
            "accept_rate_per_position": self.accept_rate_per_position,
            "num_target_forwards": self.num_target_forwards,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "time_draft": self.time_draft,
            "time_verify": self.time_verify,
            "time_other": self.time_other,
            "time_prefill": self.time_prefill,
            "time_compile": self.time_compile,
            "engine": self.engine,
            "mode": self.mode,
            "tree": asdict(self.tree) if self.tree is not None else None,
            "choices": [c.as_dict() for c in self.choices],
        }


@dataclass
class SpeculativeOutput:
    sequences: torch.Tensor  # (B, L + generated), padded like generate()'s
    stats: SpeculativeStats
    # With output_logits / output_scores, as generate() returns them: one (B, V) tensor per new token position,
    # the target's raw logits / processed scores that chose it (a row that has finished repeats its last row).
    logits: tuple | None = None
    scores: tuple | None = None
