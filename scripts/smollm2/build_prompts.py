"""Build the training prompts of the SmolLM2-135M-Instruct EAGLE-3 head, offline, from this machine alone.

Sources (nothing from a hub; HumanEval is never read):
  stdlib    instructions written from the Python standard library's own docstrings and short function sources
            (the modules this interpreter ships; pydoc's view of them);
  debian    questions about Debian packages from the apt lists (``apt-cache dumpavail``: name, one-line
            description, section), when this machine has them;
  writing, reasoning, coding, maths, knowledge: templated questions over the word lists of topics.py, with
            numbers and names drawn from a seeded generator.

Every prompt becomes a chat row ``{"messages": [user, assistant ""], "source": ...}``; the empty assistant turn is
replaced by the target's own greedy answer at training time (``--regenerate``). Prompts are deduplicated
(case and whitespace folded) and shuffled with the seed. Usage:

    python scripts/smollm2/build_prompts.py --out scripts/smollm2/prompts.jsonl.gz
"""
from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import json
import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import topics as T  # noqa: E402

# Modules that open windows, print on import, start servers or are internal.
_SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip",
                 "pydoc_data", "test", "__future__", "__main__", "sre_compile", "sre_constants", "sre_parse",
                 "msilib", "winreg", "winsound", "nturl2path", "ntpath", "msvcrt", "_winapi", "xxsubtype", "encodings"}


def _first_sentence(doc: str | None, limit: int = 220) -> str | None:
    if not doc:
        return None
    para = " ".join(doc.strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<=[.!?])\s", para)[0]
    if len(sentence) < 12 or len(sentence) > limit or ">>>" in sentence:
        return None
    return sentence


def _public_objects(mod):
    names = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
    for name in sorted(set(names)):
        obj = getattr(mod, name, None)
        if (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)) and \
                getattr(obj, "__module__", None) in (mod.__name__, None):
            yield name, obj


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _short_source(obj) -> str | None:
    if not inspect.isfunction(obj):
        return None
    try:
        src = inspect.getsource(obj)
    except (OSError, TypeError):
        return None
    lines = src.strip("\n").splitlines()
    return src.strip("\n") if 4 <= len(lines) <= 18 and len(src) < 900 else None


def _stub(src: str) -> str | None:
    """A function's ``def`` line and docstring, without its body: what a completion task shows."""
    match = re.match(r'(\s*def [^\n]*:\n\s*(?P<q>"""|\'\'\')[\s\S]*?(?P=q))', src)
    return match.group(1) if match else None


def stdlib_prompts(rng: random.Random, per_module: int) -> list[str]:
    """Instructions about the standard library's public functions and classes, from their docstrings."""
    out = []
    for modname in sorted(sys.stdlib_module_names):
        if modname.startswith("_") or modname in _SKIP_MODULES:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(modname)
        except Exception:  # platform-specific modules fail to import in many ways
            continue
        mod_doc = _first_sentence(mod.__doc__, 400)
        found = []
        if mod_doc:
            found += [f"Give an overview of Python's `{modname}` module: what is it for, and what are its most "
                      f"useful functions?",
                      f"The documentation of Python's `{modname}` module begins: \"{mod_doc}\" Explain this in "
                      f"simple words for a beginner."]
        for name, obj in _public_objects(mod):
            found += _object_prompts(modname, name, obj)
        rng.shuffle(found)
        out += found[:per_module]
    return out


def _object_prompts(modname: str, name: str, obj) -> list[str]:
    full = f"{modname}.{name}"
    doc = _first_sentence(inspect.getdoc(obj))
    prompts = []
    if inspect.isclass(obj):
        prompts.append(f"How do I create and use a `{full}` object in Python? Show a short example.")
        if doc:
            prompts.append(f"Python's documentation describes `{full}` as: \"{doc}\" When would I use it?")
        return prompts
    sig = _signature(obj)
    prompts.append(f"What does `{full}{sig}` do in Python? Explain briefly and give an example.")
    prompts.append(f"Write a short Python example that uses `{full}` and explain the output.")
    if doc:
        prompts.append(f"The Python documentation says of `{full}`: \"{doc}\" Explain this in plain words.")
        verb = re.match(r"(Return|Compute|Convert|Create|Find|Get|Split|Join|Read|Write|Check|Test)s?\b(.*)", doc)
        if verb and len(doc) < 160:
            task = verb.group(1).lower() + "s" + verb.group(2).rstrip(".")
            prompts.append(f"Write a Python function that {task}, without using `{full}`.")
    src = _short_source(obj)
    if src:
        stub = _stub(src)
        if stub:
            prompts.append(f"Complete the following Python function:\n\n```python\n{stub}\n```")
        prompts.append(f"Explain what this function from Python's `{modname}` module does, line by line:\n\n"
                       f"```python\n{src}\n```")
        prompts.append(f"Suggest how to make this Python function clearer, and rewrite it:\n\n```python\n{src}\n```")
    return prompts


def debian_prompts(rng: random.Random, count: int) -> list[str]:
    """Questions about Debian packages (one-line descriptions from the apt lists); [] without apt."""
    try:
        text = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    packages = []
    for block in text.split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", block, flags=re.M))
        name, desc = fields.get("Package"), fields.get("Description")
        if name and desc and not re.search(r"(-dev|-dbg|-doc|-data|-common|^lib.*\d)$", name):
            packages.append((name, desc.strip(), fields.get("Section", "misc")))
    rng.shuffle(packages)
    templates = [
        "What is the Debian package `{name}` ({desc})? Who would want to install it?",
        "I need {lower}. Would the Debian package `{name}` help? How would I install and start using it?",
        "Write a short announcement for a new release of {name}: {lower}.",
        "Explain to a beginner what \"{desc}\" means.",
        "The package `{name}` is in Debian's \"{section}\" section and described as \"{desc}\". Suggest three ways "
        "someone might use it.",
        "Compare `{name}` ({lower}) with other tools that do a similar job.",
    ]
    out = []
    for name, desc, section in packages[:count]:
        lower = desc[0].lower() + desc[1:]
        out.append(rng.choice(templates).format(name=name, desc=desc, lower=lower, section=section))
    return out


def writing_prompts(rng: random.Random, count: int) -> list[str]:
    out = []
    for _ in range(count):
        form, topic = rng.choice(T.WRITING_FORMS), rng.choice(T.WRITING_TOPICS)
        style = rng.choice(["", f" Use a {rng.choice(T.TONES)} tone.", " Keep it short.", ""])
        out.append(f"Write {form} about {topic}.{style}")
    return out


def reasoning_prompts(rng: random.Random, count: int) -> list[str]:
    out = []
    for _ in range(count):
        a, b, c = rng.sample(T.NAMES, 3)
        kind = rng.randrange(6)
        if kind == 0:
            rel = rng.choice(["taller", "older", "faster", "richer"])
            out.append(f"{a} is {rel} than {b}, and {b} is {rel} than {c}. Who is the least {rel[:-2]}? Explain "
                       f"your reasoning step by step.")
        elif kind == 1:
            start, step = rng.randint(1, 9), rng.randint(2, 7)
            seq = [start + i * step for i in range(5)] if rng.random() < .5 else [start * step ** i for i in range(5)]
            out.append(f"What number comes next in the sequence {', '.join(map(str, seq))}? Explain the pattern.")
        elif kind == 2:
            days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
            out.append(f"If today is {rng.choice(days)}, what day of the week will it be in {rng.randint(2, 60)} "
                       f"days? Show how you worked it out.")
        elif kind == 3:
            n, m = rng.randint(3, 12), rng.randint(2, 5)
            out.append(f"{a} has {n} {rng.choice(T.ITEMS)} and gives {b} {m} of them. Then {b} gives half of what "
                       f"{b} has back to {a}. If {b} started with none, how many does each have now?")
        elif kind == 4:
            out.append(f"All {rng.choice(['cats', 'birds', 'engineers', 'teachers'])} in the story are friendly. "
                       f"{a} is in the story and is not friendly. What can we conclude about {a}? Explain.")
        else:
            out.append(f"{a}, {b} and {c} sit in a row. {a} is not at either end, and {b} sits to the left of {a}. "
                       f"Where does {c} sit? Explain step by step.")
    return out


def coding_prompts(rng: random.Random, count: int) -> list[str]:
    out = list(T.CODE_QUESTIONS)
    while len(out) < count:
        lang, task = rng.choice(T.LANGUAGES), rng.choice(T.CODE_TASKS)
        form = rng.choice(["Write a {lang} function that {task}.", "Write a {lang} function that {task}, with a "
                           "short explanation.", "How would you write a {lang} program that {task}?",
                           "Write a {lang} function that {task}, and a few tests for it."])
        out.append(form.format(lang=lang, task=task))
    return out


def maths_prompts(rng: random.Random, count: int) -> list[str]:
    out = []
    for _ in range(count):
        kind, a, b, c = rng.randrange(7), rng.randint(2, 40), rng.randint(2, 40), rng.randint(1, 99)
        if kind == 0:
            out.append(f"Solve for x: {a}x + {c} = {a * b + c}. Show each step.")
        elif kind == 1:
            out.append(f"What is {rng.randint(5, 95)}% of {rng.randint(20, 2000)}? Explain how to compute it.")
        elif kind == 2:
            out.append(f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?")
        elif kind == 3:
            out.append(f"A shop sells {rng.choice(T.ITEMS)} at {a} dollars each. How much do {b} of them cost "
                       f"after a {rng.choice([10, 15, 20, 25])}% discount?")
        elif kind == 4:
            out.append(f"What is the derivative of {a}x^3 + {b}x^2 + {c}? Explain the rule you use.")
        elif kind == 5:
            out.append(f"A train travels {a * 10} km in {rng.choice([2, 4, 5])} hours. What is its average speed, "
                       f"and how far does it go in {b} hours at that speed?")
        else:
            out.append(f"I roll two fair dice. What is the probability that their sum is {rng.randint(2, 12)}? "
                       f"Explain.")
    return out


def knowledge_prompts(rng: random.Random) -> list[str]:
    out = []
    for concept in T.CONCEPTS:
        out += [f"Explain {concept} in simple terms.", f"What are three surprising facts about {concept}?",
                f"Explain {concept} to a ten-year-old."]
    for country in T.COUNTRIES:
        out += [f"What is the capital of {country}, and what is it known for?",
                f"Tell me about the geography and climate of {country}.",
                f"What are some traditional foods of {country}?"]
    for person in T.PEOPLE:
        out += [f"Who was {person}, and why are they famous?", f"What can we learn from the life of {person}?"]
    for _ in range(len(T.CONCEPTS)):
        a, b = rng.sample(T.CONCEPTS, 2)
        out.append(f"How are {a} and {b} related, if at all?")
    return out


def build(seed: int, per_module: int, debian: int, writing: int, reasoning: int, coding: int,
          maths: int) -> list[dict]:
    rng = random.Random(seed)
    sources = {"stdlib": stdlib_prompts(rng, per_module), "debian": debian_prompts(rng, debian),
               "writing": writing_prompts(rng, writing), "reasoning": reasoning_prompts(rng, reasoning),
               "coding": coding_prompts(rng, coding), "maths": maths_prompts(rng, maths),
               "knowledge": knowledge_prompts(rng)}
    seen, rows = set(), []
    for source, prompts in sources.items():
        for p in prompts:
            key = " ".join(p.lower().split())
            if key not in seen:
                seen.add(key)
                rows.append({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": ""}],
                             "source": source})
    rng.shuffle(rows)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the .jsonl.gz file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-module", type=int, default=24, help="stdlib prompts per module at most")
    parser.add_argument("--debian", type=int, default=3000)
    parser.add_argument("--writing", type=int, default=1500)
    parser.add_argument("--reasoning", type=int, default=1000)
    parser.add_argument("--coding", type=int, default=1500)
    parser.add_argument("--maths", type=int, default=1000)
    args = parser.parse_args(argv)
    rows = build(args.seed, args.per_module, args.debian, args.writing, args.reasoning, args.coding, args.maths)
    counts = {}
    for r in rows:
        counts[r["source"]] = counts.get(r["source"], 0) + 1
    # mtime=0: the same prompts give the same bytes
    with open(args.out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        for r in rows:
            f.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
    print(f"wrote {len(rows)} prompts to {args.out}: {json.dumps(counts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
