"""The decode loop's per-call state, and what speculative_generate returns with ``return_dict_in_generate=True``."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from transformers.generation import GenerateDecoderOnlyOutput

from ..config import TreeConfig
from .processors import CallRows, needs_call_batch, reads_input_ids, reads_tokens

__all__ = ["Call", "DecodeState", "PhaseClock", "SpeculativeOutput", "SpeculativeStats", "PHASES"]

PHASES = ("draft", "verify", "accept", "update")  # the cycle's phases ``profile=True`` times on the device


@dataclass
class DecodeState:
    """What the host keeps per row; the device side lives in the decoder's storage (``storage.py``)."""

    prompt: list[list[int]]  # per row, the (padded) prompt as generate() sees it
    generated: list[list[int]]  # per row, committed new tokens
    finished: list[bool]
    first: torch.Tensor  # (B,) the prefill's token, on the host
    rope_offsets: torch.Tensor | None  # (3, B') M-RoPE offset of each axis from the text position (storage rows)
    # output_logits / output_scores: per row, the target's raw / processed (V,) rows behind each committed token
    logits: list[list[torch.Tensor]] | None = None
    scores: list[list[torch.Tensor]] | None = None
    slots: list[int] = field(default_factory=list)  # [i]: the row in the storage's row i (fewer once rows finish)
    drafted: bool = False  # the next cycle's tree was drafted ahead (on CUDA, while the host committed)
    shrink: bool = False  # rows finished since the storage last dropped finished rows

    def __post_init__(self):
        if not self.slots:
            self.slots = list(range(len(self.prompt)))

    def lengths(self) -> list[int]:
        """Each storage row's sequence length so far, the root included (what the stopping criteria and the
        length-only processors read)."""
        return [len(self.prompt[b]) + len(self.generated[b]) for b in self.slots]

    def row(self, b: int) -> torch.Tensor:
        return torch.tensor(self.prompt[b] + self.generated[b], dtype=torch.long)

    def output(self, input_ids: torch.Tensor, pad: int, stats: "SpeculativeStats | None"):
        """What the call returns: the sequences (B, T + new), padded with ``pad`` after a row's end as generate()'s;
        with ``stats`` (``return_dict_in_generate``), a ``SpeculativeOutput`` holding them, the stats and the logits and
        scores kept per new token."""
        width = max(len(g) for g in self.generated)
        new = torch.full((input_ids.shape[0], width), pad, dtype=input_ids.dtype)
        for b, g in enumerate(self.generated):
            new[b, : len(g)] = torch.tensor(g, dtype=input_ids.dtype)
        sequences = torch.cat((input_ids, new.to(input_ids.device)), 1)
        if stats is None:
            return sequences
        return SpeculativeOutput(sequences=sequences, stats=stats, logits=_per_step(self.logits),
                                 scores=_per_step(self.scores))

    def call_rows(self, processors, pad: int) -> CallRows | None:
        """What the processors read of the call's rows (``CallRows``): the sequences of the rows in the storage (or
        only their lengths when no processor reads tokens: min-length processors need no per-row tensors each cycle),
        of every row when a processor may read the row index (``needs_call_batch``); None when none reads them."""
        if not reads_input_ids(processors):
            return None
        seqs: list = [None] * len(self.prompt)
        rows = range(len(seqs)) if needs_call_batch(processors) else self.slots
        for b in rows:
            seqs[b] = self.row(b) if reads_tokens(processors) else len(self.prompt[b]) + len(self.generated[b])
        return CallRows(seqs, self.slots, pad)

    def keep(self, keep: list[int]) -> None:
        """The storage went on with its rows ``keep`` (``storage.plan``), in that order."""
        self.slots = [self.slots[i] for i in keep]
        if self.rope_offsets is not None:
            self.rope_offsets = self.rope_offsets[:, keep]


def _per_step(rows: list[list[torch.Tensor]] | None):
    """Per-row lists of (V,) rows -> generate()'s tuple of (B, V) per new token (a finished row repeats its last)."""
    if rows is None:
        return None
    width = max(len(r) for r in rows)
    return tuple(torch.stack([r[min(i, len(r) - 1)] for r in rows]) for i in range(width))


@dataclass
class SpeculativeStats:
    """Acceptance statistics of one call; acceptance counts are before any stopping truncation."""

    num_target_forwards: int = 0  # verify forwards (the prefill is not counted)
    num_drafts: int = 0  # (row, cycle) pairs drafted
    num_draft_tokens: int = 0  # draft nodes sent to verification, over all rows
    accept_counts: list[int] = field(default_factory=list)  # [i]: drafts whose accepted length >= i+1
    # [i]: drafts whose accepted nodes at depths 1..i+1 were all the head's first choices (rank 0 among their
    # siblings); equal to accept_counts for a chain. The chooser's acceptance fit tells a tree's first choices from
    # the rest by it (``acceptance.py``).
    first_counts: list[int] = field(default_factory=list)
    accepted_tokens: int = 0  # tokens gained from verify forwards (accepted + bonus)
    # Host seconds per part of the cycles. On CUDA the steps are launched and the GPU runs them behind: the draft and
    # the verify count their launches, and the GPU's time shows where the host waits for it, in time_other's read.
    time_draft: float = 0.0  # the draft steps (head forwards growing trees)
    time_verify: float = 0.0  # the target's verify forwards, the logits processors and the acceptance
    time_other: float = 0.0  # the update step (keep the path, extend the head), the one host read, committing tokens
    time_prefill: float = 0.0  # seconds from the call's start to its first token: prefill forward and setup
    time_compile: float = 0.0  # seconds of the above spent compiling or capturing graphs (first calls of a shape)
    tree: TreeConfig | None = None  # the draft tree the loop started with (``TreeConfig.none()``: no draft)
    # The chooser's decisions (``chooser.TreeChoice``: the tree, the batch, why, the finalists' expected rates), the
    # first at the start and one whenever it picked again; empty when the call was given a tree.
    choices: list = field(default_factory=list)
    # With ``profile=True``: seconds per phase (``PHASES``) on the device's stream over the call's cycles, each from the
    # event recorded before its first launch to the one after its last (CUDA events; on a CPU the host's clock, the
    # steps running as they are called). A span includes what the device waited for the host's launches inside it;
    # the host's share of the cycles is their wall time less the spans. None without ``profile``.
    device_time: dict | None = None
    engine: str = "fixed"  # the storage: always the engine's fixed buffers (the one storage)
    mode: str | None = None  # how the steps ran: None eagerly, "graphs" (CUDA graphs), or a torch.compile mode

    def count(self, accepted: list[int], n_draft: int, first: list[int] | None = None) -> None:
        """One verify forward's acceptance: ``accepted`` draft tokens for each row still live, of ``n_draft``;
        ``first``: how many of them, from the root on, were the head's first choices (None: not known)."""
        self.num_target_forwards += 1
        n = len(accepted)
        self.num_drafts += n
        self.num_draft_tokens += n * n_draft
        self.accepted_tokens += sum(accepted) + n
        if n_draft:  # a cycle without a tree accepts nothing: no per-row loop (64 rows cost 20 us a cycle)
            for a in accepted:
                for j in range(a):
                    self.accept_counts[j] += 1
            for f in first or ():
                for j in range(f):
                    self.first_counts[j] += 1

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
            "device_time": self.device_time,
            "engine": self.engine,
            "mode": self.mode,
            "tree": asdict(self.tree) if self.tree is not None else None,
            "choices": [c.as_dict() for c in self.choices],
        }


class PhaseClock:
    """``profile=True``'s timer: ``begin()`` before a cycle's first launch, ``mark(phase)`` after each phase's last;
    ``totals()`` at the call's end sums the spans per phase. On CUDA the marks are events on the current stream (no
    host wait until ``totals``); on a CPU, host times."""

    def __init__(self, device: torch.device):
        self.device = device
        self._spans: list = []  # (phase or None for a begin, event or host seconds)

    def _now(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the decoder's GPU, whichever is current
        return event

    def begin(self) -> None:
        self._spans.append((None, self._now()))

    def mark(self, phase: str) -> None:
        self._spans.append((phase, self._now()))

    def totals(self) -> dict:
        """Seconds per phase (every phase of ``PHASES``, 0.0 where none ran)."""
        out = dict.fromkeys(PHASES, 0.0)
        cuda = self.device.type == "cuda"
        if cuda and self._spans:
            self._spans[-1][1].synchronize()
        for (_, a), (phase, b) in zip(self._spans, self._spans[1:]):
            if phase is not None:  # a begin ends nothing: the gap before it is the host's
                out[phase] += a.elapsed_time(b) / 1e3 if cuda else b - a
        return out


@dataclass
class SpeculativeOutput(GenerateDecoderOnlyOutput):
    """What ``speculative_generate`` returns with ``return_dict_in_generate=True``: ``generate``'s own output class
    (``GenerateDecoderOnlyOutput``: ``out.sequences``, ``out["sequences"]``, ``out[0]``, ``to_tuple()``) plus
    ``stats``, the call's ``SpeculativeStats``.

    ``sequences``: (B, L + generated), padded like generate()'s. With ``output_logits`` / ``output_scores``,
    ``logits`` / ``scores`` are as generate() returns them: one (B, V) tensor per new token position, the target's
    raw logits / processed scores that chose it (a row that has finished repeats its last row). The cache
    (``cache``; ``past_key_values`` in older transformers) is None: the loop's cache holds draft-tree
    slots that a later ``generate`` call could not continue from. ``attentions`` and ``hidden_states`` are None
    (``output_attentions`` / ``output_hidden_states`` are refused).
    """

    stats: SpeculativeStats | None = None


@dataclass(kw_only=True)
class Call:
    """What the prefill and every cycle of one call read (built by keyword: it has many fields)."""

    model: object
    head: object
    dec: object  # the Decoder of (model, head, device)
    cap: object  # FeatureCapture: the decoder's, entered for the call
    gen: object  # generate()'s generation config
    processors: object  # generate()'s logits processors
    stops: object  # stopping.Stops: generate()'s criteria
    streamer: object
    generator: torch.Generator | None
    stats: SpeculativeStats
    parts: object  # the target's TargetParts
    limit: int | None  # the target's position limit (TargetParts.position_limit)
    # The context the verify and the update run in (``skinny_linears`` on a CPU, or none): their forwards take Q and
    # D+1 rows; every torch call costs a few microseconds more there, so the draft (on a CPU mostly one row per
    # level) and the host's bookkeeping run outside it.
    linears: object
    pad: int  # the token generate() writes after a finished row
    session: object  # session.Session when the call was given no tree (the chooser's: it picks before each cycle)
    new: int  # new tokens per row the call decodes at most
    few_rows: object  # (batch, q) -> whether a forward of q tokens per row takes the few-row linears
    clock: PhaseClock | None  # profile=True: the phases' device time
    eos: dict = field(default_factory=dict)  # id(length-only processor) -> its EOS ids on the device (``cycle_ops``)
