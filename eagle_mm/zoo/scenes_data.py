"""Scenes: a procedural image-text data set drawn with pillow, for training and testing small vision-language models.

A scene is 1-6 shapes (a kind, a colour, a size) in the cells of a 3x3 grid, and in most scenes 1-2 short
words written with pillow's built-in bitmap font in a grid row that no shape uses. Everything follows from
one integer seed: ``make_scene(seed)`` draws the scene, ``render`` draws it, ``caption`` and ``qa_pairs``
describe it in canonical words. Seeds below ``VALIDATION_SEEDS.stop`` make validation scenes, the rest
training scenes, and a scene's content (its caption) decides which split may hold it, so no validation
scene appears in training even by chance. ``examples`` and ``to_jsonl`` give one task per scene;
``score`` and ``accuracy`` grade answers by normalised exact match.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from math import cos, pi, sin
from pathlib import Path
from typing import Iterable, Iterator

from PIL import Image, ImageDraw, ImageFont

__all__ = ["Shape", "Scene", "make_scene", "render", "caption", "qa_pairs", "examples", "to_jsonl", "score",
           "accuracy", "KINDS", "COLOURS", "SIZES", "POSITIONS", "WORDS", "TASKS", "SPLITS", "TRAIN_SEEDS",
           "VALIDATION_SEEDS", "DEFAULT_SIZE"]

KINDS = ("circle", "square", "triangle", "star")
COLOURS = {"red": (230, 40, 40), "orange": (245, 140, 20), "yellow": (240, 220, 30), "green": (40, 180, 70),
           "blue": (40, 100, 240), "purple": (160, 70, 210)}
SIZES = ("small", "large")
# Cell i of the grid is row i // 3, column i % 3, in reading order.
POSITIONS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
# 3-6 lowercase letters; no colour, kind, position, size or number words, so a word read is never a shape's.
WORDS = ("ant", "bat", "bee", "cat", "cow", "dog", "elk", "hen", "owl", "pig", "yak", "fox", "apple", "bread",
         "cake", "corn", "egg", "fig", "jam", "lemon", "melon", "pear", "rice", "soup", "tea", "boat", "car", "bus",
         "ship", "train", "bike", "kite", "drum", "bell", "lamp", "book", "door", "hat", "sock", "shoe", "coat",
         "chair", "table", "house", "tree", "leaf", "rock", "sand", "rain", "snow", "wind", "moon", "cloud",
         "river", "lake", "hill", "field", "forest", "garden", "pencil", "window", "button", "rabbit", "tiger",
         "zebra", "horse", "mouse", "sheep", "goat", "frog", "fish", "crab", "duck", "swan", "wolf", "bear",
         "lion", "deer", "seal", "whale")
TASKS = ("caption", "count", "colour", "position", "relation", "text")
SPLITS = ("train", "validation")
VALIDATION_SEEDS = range(0, 100_000)  # fixed: validation example i always comes from seed i
TRAIN_SEEDS = range(100_000, 2**32)
DEFAULT_SIZE = 96  # the widest text (13 bitmap-font characters, 78 px) fits a 96 px row at its native size

_BACKGROUND = (0, 0, 0)
_TEXT_COLOUR = (255, 255, 255)  # not a palette colour: text is never mistaken for a shape
_RADIUS = {"small": 0.22, "large": 0.42}  # a shape's half-extent, as a fraction of a cell's side
_MARGIN = 0.02  # of a cell's side, kept clear between a shape and its cell's edge
_MAX_TEXT_CHARS = 13
_VALIDATION_SHARE = 10  # one scene content in ten is validation-only
_PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles", "star": "stars"}
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(("zero", "one", "two", "three", "four", "five", "six", "seven",
                                                  "eight", "nine", "ten"))}


@dataclass(frozen=True)
class Shape:
    """One shape: ``cell`` is 0-8 in reading order; ``offset`` moves its centre by a fraction of a cell."""

    kind: str
    colour: str
    size: str
    cell: int
    offset: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self):
        for name, value, allowed in (("kind", self.kind, KINDS), ("colour", self.colour, tuple(COLOURS)),
                                     ("size", self.size, SIZES), ("cell", self.cell, tuple(range(9)))):
            if value not in allowed:
                raise ValueError(f"Shape {name}={value!r}: expected one of {list(allowed)}")
        limit = 0.5 - _RADIUS[self.size] - _MARGIN
        if len(self.offset) != 2 or any(abs(o) > limit for o in self.offset):
            raise ValueError(f"Shape offset={self.offset}: expected two fractions within +-{limit:.2f} for a "
                             f"{self.size} shape, so it stays inside its cell")

    @property
    def position(self) -> str:
        return POSITIONS[self.cell]


@dataclass(frozen=True)
class Scene:
    """Shapes in distinct cells, and words written across grid row ``text_row`` (None when there are none)."""

    shapes: tuple[Shape, ...]
    words: tuple[str, ...] = ()
    text_row: int | None = None
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "shapes", tuple(self.shapes))
        object.__setattr__(self, "words", tuple(self.words))
        if not 1 <= len(self.shapes) <= 6:
            raise ValueError(f"a scene holds 1-6 shapes, got {len(self.shapes)}")
        cells = [s.cell for s in self.shapes]
        if len(set(cells)) != len(cells):
            raise ValueError(f"shapes share a cell: cells {cells}")
        if len(self.words) > 2 or (self.text_row is None) != (not self.words):
            raise ValueError(f"expected 0-2 words and a text_row in 0-2 exactly when there are words, got "
                             f"words={self.words} text_row={self.text_row}")
        if self.words:
            text = " ".join(self.words)
            if self.text_row not in (0, 1, 2) or len(text) > _MAX_TEXT_CHARS or not re.fullmatch(r"[a-z ]+", text):
                raise ValueError(f"text {text!r} in row {self.text_row}: expected lowercase words of at most "
                                 f"{_MAX_TEXT_CHARS} characters in all, in row 0, 1 or 2")
            if any(c // 3 == self.text_row for c in cells):
                raise ValueError(f"a shape is in text row {self.text_row} (cells {cells}); text and shapes "
                                 f"must not overlap")


# ---- drawing a scene from a seed --------------------------------------------------------------------
def make_scene(seed: int) -> Scene:
    """The scene of ``seed``: a pure function of it. The seed's range picks the split (see module doc)."""
    if not 0 <= seed < TRAIN_SEEDS.stop:
        raise ValueError(f"seed={seed}: expected 0 <= seed < {TRAIN_SEEDS.stop}")
    validation = seed in VALIDATION_SEEDS
    rng = random.Random(seed)
    while True:  # redraw until the content belongs to this split: about 1.1 draws for train, 10 for validation
        scene = _draw(rng, seed)
        if _is_validation_content(scene) == validation:
            return scene


def _draw(rng: random.Random, seed: int) -> Scene:
    n_words = rng.choices((0, 1, 2), weights=(1, 2, 2))[0]
    text_row = rng.randrange(3) if n_words else None
    free = [c for c in range(9) if c // 3 != text_row]
    cells = sorted(rng.sample(free, rng.randint(1, 6)))
    shapes = []
    for cell in cells:
        kind, colour, size = rng.choice(KINDS), rng.choice(tuple(COLOURS)), rng.choice(SIZES)
        jitter = 0.5 - _RADIUS[size] - _MARGIN
        offset = (round(rng.uniform(-jitter, jitter), 3), round(rng.uniform(-jitter, jitter), 3))
        shapes.append(Shape(kind, colour, size, cell, offset))
    return Scene(tuple(shapes), tuple(rng.sample(WORDS, n_words)), text_row, seed)


def _is_validation_content(scene: Scene) -> bool:
    digest = hashlib.sha256(caption(scene).encode()).digest()
    return int.from_bytes(digest[:4], "big") % _VALIDATION_SHARE == 0


# ---- rendering ----------------------------------------------------------------------------------------
def render(scene: Scene, size: int = DEFAULT_SIZE) -> Image.Image:
    """An RGB ``size`` x ``size`` image of the scene on black; text is pixel-exact bitmap font at size 96."""
    if not isinstance(size, int) or size < 48:
        raise ValueError(f"size={size!r}: expected an int of at least 48 (pixels per side)")
    image = Image.new("RGB", (size, size), _BACKGROUND)
    draw = ImageDraw.Draw(image)
    cell = size / 3
    for s in scene.shapes:
        cx = (s.cell % 3 + 0.5 + s.offset[0]) * cell
        cy = (s.cell // 3 + 0.5 + s.offset[1]) * cell
        _draw_shape(draw, s.kind, cx, cy, _RADIUS[s.size] * cell, COLOURS[s.colour])
    if scene.words:
        _draw_text(image, " ".join(scene.words), scene.text_row, size)
    return image


def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float, fill) -> None:
    if kind == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif kind == "square":
        h = 0.85 * r  # a square as wide as the circle looks larger; this evens their areas a little
        draw.rectangle((cx - h, cy - h, cx + h, cy + h), fill=fill)
    elif kind == "triangle":
        draw.regular_polygon((cx, cy + 0.15 * r, r), 3, fill=fill)  # pointing up, nudged down to sit centred
    else:  # a five-pointed star, one point up
        points = [(cx + (r if k % 2 == 0 else 0.42 * r) * sin(k * pi / 5),
                   cy - (r if k % 2 == 0 else 0.42 * r) * cos(k * pi / 5)) for k in range(10)]
        draw.polygon(points, fill=fill)


def _draw_text(image: Image.Image, text: str, row: int, size: int) -> None:
    # The bitmap font (not load_default()'s FreeType font) is pure pillow data: the same pixels everywhere.
    font = ImageFont.load_default_imagefont()
    left, top, right, bottom = font.getbbox(text)
    mask = Image.new("L", (right - left, bottom - top), 0)
    ImageDraw.Draw(mask).text((-left, -top), text, font=font, fill=255)
    scale = size / DEFAULT_SIZE
    if scale != 1:  # nearest keeps the strokes sharp when enlarging; box averages them when shrinking
        w, h = max(1, round(mask.width * scale)), max(1, round(mask.height * scale))
        mask = mask.resize((w, h), Image.Resampling.NEAREST if scale > 1 else Image.Resampling.BOX)
    x = (size - mask.width) // 2
    y = round((row + 0.5) * size / 3 - mask.height / 2)
    image.paste(_TEXT_COLOUR, (x, y, x + mask.width, y + mask.height), mask)


# ---- words ----------------------------------------------------------------------------------------------
def caption(scene: Scene) -> str:
    """The canonical description: the shapes in reading order, then the text."""
    parts = [f"a {s.size} {s.colour} {s.kind} at the {s.position}" for s in sorted(scene.shapes, key=_cell)]
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    n = len(parts)
    out = f"{n} shape{'s' if n > 1 else ''}: {listed}."
    if scene.words:
        out += f' The text says "{" ".join(scene.words)}".'
    return out


def _cell(shape: Shape) -> int:
    return shape.cell


def qa_pairs(scene: Scene) -> list[tuple[str, str, str]]:
    """Every (task, question, answer) the scene answers unambiguously, in a fixed order.

    Colour, position and relation questions name a kind (or colour) only when exactly one shape has it;
    count questions cover every colour, kind and size present, and one absent colour and kind (answer "0").
    """
    shapes = sorted(scene.shapes, key=_cell)
    kinds, colours = Counter(s.kind for s in shapes), Counter(s.colour for s in shapes)
    sizes = Counter(s.size for s in shapes)
    out = [("caption", "Describe the image.", caption(scene))]
    out.append(("count", "How many shapes are there?", str(len(shapes))))
    # Present colours and kinds, and one absent one of each (answer "0"), which one turning with the seed.
    asked_colours = [c for c in COLOURS if c in colours] + _one_absent(COLOURS, colours, scene.seed)
    asked_kinds = [k for k in KINDS if k in kinds] + _one_absent(KINDS, kinds, scene.seed)
    out += [("count", f"How many {c} shapes?", str(colours[c])) for c in asked_colours]
    out += [("count", f"How many {_PLURAL[k]}?", str(kinds[k])) for k in asked_kinds]
    out += [("count", f"How many {z} shapes?", str(sizes[z])) for z in SIZES if z in sizes]
    unique = [s for s in shapes if kinds[s.kind] == 1]
    out += [("colour", f"What colour is the {s.kind}?", s.colour) for s in unique]
    out += [("position", f"Where is the {s.kind}?", s.position) for s in unique]
    out += [("position", f"Where is the {s.colour} shape?", s.position) for s in shapes if colours[s.colour] == 1]
    # Only pairs in different columns (rows): "left of" ("above") is then clear, and yes and no come equally.
    for a in unique:
        for b in unique:
            if a.cell % 3 != b.cell % 3:
                out.append(("relation", f"Is the {a.kind} left of the {b.kind}?", _yes(a.cell % 3 < b.cell % 3)))
            if a.cell // 3 != b.cell // 3:
                out.append(("relation", f"Is the {a.kind} above the {b.kind}?", _yes(a.cell // 3 < b.cell // 3)))
    if scene.words:
        out.append(("text", "What does the text say?", " ".join(scene.words)))
    return out


def _one_absent(names, present: Counter, seed: int) -> list[str]:
    absent = [x for x in names if x not in present]
    return [absent[seed % len(absent)]] if absent else []


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


# ---- examples and files -------------------------------------------------------------------------------
def examples(split: str, n: int, *, size: int = DEFAULT_SIZE, tasks: Iterable[str] | None = None) -> Iterator[dict]:
    """``n`` examples ``dict(image, task, prompt, answer, seed)``, one per scene, from the split's first seeds.

    Each scene's task is drawn uniformly from the tasks it can answer (restricted to ``tasks`` when given;
    scenes that answer none are skipped), then its question uniformly within the task.
    """
    wanted, seeds = _check_tasks(tasks), _split_seeds(split, n)  # checked now, not at the first next()
    return _examples(seeds, n, size, wanted)


def _examples(seeds: range, n: int, size: int, wanted: tuple[str, ...]) -> Iterator[dict]:
    given = 0
    for seed in seeds:
        if given == n:
            return
        scene = make_scene(seed)
        picked = _pick(scene, wanted)
        if picked is None:
            continue
        given += 1
        task, prompt, answer = picked
        yield {"image": render(scene, size), "task": task, "prompt": prompt, "answer": answer, "seed": seed}


def _check_tasks(tasks) -> tuple[str, ...]:
    wanted = TASKS if tasks is None else tuple(tasks)
    bad = [t for t in wanted if t not in TASKS]
    if bad or not wanted:
        raise ValueError(f"tasks={list(wanted)}: expected a non-empty subset of {list(TASKS)}")
    return wanted


def _split_seeds(split: str, n: int) -> range:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {list(SPLITS)}")
    seeds = VALIDATION_SEEDS if split == "validation" else TRAIN_SEEDS
    if not 0 <= n <= len(seeds):
        raise ValueError(f"n={n}: expected 0 <= n <= {len(seeds)}, the number of {split} seeds")
    return seeds


def _pick(scene: Scene, wanted: tuple[str, ...]) -> tuple[str, str, str] | None:
    by_task = defaultdict(list)
    for qa in qa_pairs(scene):
        if qa[0] in wanted:
            by_task[qa[0]].append(qa)
    if not by_task:
        return None
    rng = random.Random(f"{scene.seed}/question")  # str seeds hash with sha512: the same pick in every process
    return rng.choice(by_task[rng.choice(sorted(by_task))])


def to_jsonl(split: str, n: int, out_dir, *, size: int = DEFAULT_SIZE, tasks: Iterable[str] | None = None) -> Path:
    """Write ``n`` examples as PNGs under ``out_dir/images/<split>/`` and chat rows to ``out_dir/<split>.jsonl``.

    A row is ``{"images": [path relative to out_dir], "messages": [user: image + question, assistant: answer],
    "task": ..., "seed": ...}``. Returns the JSON-lines path.
    """
    out_dir = Path(out_dir)
    image_dir = out_dir / "images" / split
    image_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{split}.jsonl"
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for i, ex in enumerate(examples(split, n, size=size, tasks=tasks)):
            rel = f"images/{split}/{i:06d}.png"
            ex["image"].save(out_dir / rel, format="PNG")
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ex["prompt"]}]},
                        {"role": "assistant", "content": ex["answer"]}]
            row = {"images": [rel], "messages": messages, "task": ex["task"], "seed": ex["seed"]}
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path


# ---- grading --------------------------------------------------------------------------------------------
def score(task: str, prediction: str, answer: str) -> bool:
    """Exact match after normalising case, spacing, punctuation, hyphens, number words and "centre"."""
    if task not in TASKS:
        raise ValueError(f"task={task!r}: expected one of {list(TASKS)}")
    return _normalise(prediction) == _normalise(answer)


def _normalise(text: str) -> str:
    words = re.sub(r"[^a-z0-9 ]", " ", text.lower().replace("-", " ").replace("_", " ")).split()
    return " ".join(_NUMBER_WORDS.get(w, "center" if w == "centre" else w) for w in words)


def accuracy(results: Iterable[tuple[str, str, str]]) -> dict[str, float]:
    """Per-task accuracy of ``(task, prediction, answer)`` triples, and ``"all"`` over every triple."""
    right, total = Counter(), Counter()
    for task, prediction, answer in results:
        ok = score(task, prediction, answer)
        for key in (task, "all"):
            right[key] += ok
            total[key] += 1
    return {k: right[k] / total[k] for k in total}
