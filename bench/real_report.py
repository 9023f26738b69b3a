"""bench_real.py's tallies and tables: each method's tokens, seconds and acceptance over prompts, and the speed
table per prompt set with the ratios of ours to HF's methods."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Tally:
    """One method's totals over prompts: tokens and seconds, and for ours its acceptance statistics."""

    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    drafts: int = 0
    accepted: int = 0
    counts: list = field(default_factory=list)
    capture_s: float = 0.0  # what ours's calls spent capturing or compiling (0 once warm)

    def add(self, tokens: int, seconds: float, stats=None) -> None:
        self.prompts, self.tokens, self.seconds = self.prompts + 1, self.tokens + tokens, self.seconds + seconds
        if stats is not None:
            self.merge(Tally(0, 0, 0.0, stats.num_drafts, stats.accepted_tokens, list(stats.accept_counts),
                             stats.time_compile))

    def merge(self, other: "Tally") -> None:
        self.prompts, self.tokens, self.seconds = (self.prompts + other.prompts, self.tokens + other.tokens,
                                                   self.seconds + other.seconds)
        self.drafts, self.accepted = self.drafts + other.drafts, self.accepted + other.accepted
        n = max(len(self.counts), len(other.counts))
        self.counts = [a + b for a, b in zip(self.counts + [0] * (n - len(self.counts)),
                                             other.counts + [0] * (n - len(other.counts)))]
        self.capture_s += other.capture_s

    def as_dict(self) -> dict:
        out = {"prompts": self.prompts, "new_tokens": self.tokens, "seconds": round(self.seconds, 4),
               "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else None}
        if self.drafts:
            out.update(mean_accept_length=round(self.accepted / self.drafts, 4),
                       accept_rate_per_position=[round(c / self.drafts, 4) for c in self.counts],
                       target_forwards=self.drafts, capture_s=round(self.capture_s, 3))
        return out


def speed_table(tallies: dict, sets, methods) -> dict:
    table = {}
    for s in [*sets, "all"]:
        rows = {m: Tally() for m in methods}
        for (s2, m), t in tallies.items():
            if s in (s2, "all"):
                rows[m].merge(t)
        table[s] = {m: r.as_dict() for m, r in rows.items()}
        speed = {m: d["tokens_per_s"] for m, d in table[s].items() if d["tokens_per_s"]}
        table[s]["ratios"] = {f"{a}/{b}": round(speed[a] / speed[b], 3) for a in speed if a.startswith("ours")
                              for b in speed if b.startswith("hf")}
    return table


def print_speed(name: str, phase: dict) -> None:
    for s, rows in (phase.get("sets") or {}).items():
        speeds = "  ".join(f"{m} {d['tokens_per_s']}" for m, d in rows.items() if m != "ratios")
        print(f"{name:15} {s:9} tok/s: {speeds}  ratios {rows['ratios']}", flush=True)
    for row in phase.get("exactness") or ():
        differ = {m: v["text"] for m, v in row.items() if m != "id" and v["verdict"] != "identical"}
        if differ:
            print(f"{name:15} {row['id']}: {differ}", flush=True)
