"""The procedural scenes data set: reproducible, split cleanly, every answer true of its scene, files loadable."""
from __future__ import annotations

import io
import json
import re
from collections import Counter

import pytest
from PIL import Image

from eagle_mm.zoo import scenes_data as sd

SEEDS = list(range(60)) + list(range(100_000, 100_140))  # validation and training scenes


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


# ---- reproducibility and splits --------------------------------------------------------------------
def test_same_seed_same_scene_bytes_and_text():
    for seed in (0, 7, 100_000, 123_456_789):
        a, b = sd.make_scene(seed), sd.make_scene(seed)
        assert a == b and a.seed == seed
        assert _png(sd.render(a)) == _png(sd.render(b))
        assert sd.caption(a) == sd.caption(b) and sd.qa_pairs(a) == sd.qa_pairs(b)
    first = [(e["seed"], e["task"], e["prompt"], e["answer"], _png(e["image"])) for e in sd.examples("train", 12)]
    again = [(e["seed"], e["task"], e["prompt"], e["answer"], _png(e["image"])) for e in sd.examples("train", 12)]
    assert first == again
    assert len({sd.caption(sd.make_scene(s)) for s in SEEDS}) > 0.9 * len(SEEDS), "seeds should give varied scenes"


def test_splits_disjoint_by_seed_and_by_content():
    assert set(sd.VALIDATION_SEEDS).isdisjoint(range(sd.TRAIN_SEEDS.start, sd.TRAIN_SEEDS.start + 10**6))
    assert sd.VALIDATION_SEEDS.stop <= sd.TRAIN_SEEDS.start
    val = list(sd.examples("validation", 40))
    train = list(sd.examples("train", 120))
    assert [e["seed"] for e in val] == list(range(40)), "validation seeds are fixed: example i is seed i"
    assert all(e["seed"] in sd.TRAIN_SEEDS for e in train)
    # Content, not just seeds: a one-shape scene without text recurs by chance, but only within its split.
    val_captions = {sd.caption(sd.make_scene(s)) for s in range(300)}
    train_captions = {sd.caption(sd.make_scene(s)) for s in range(100_000, 103_000)}
    assert val_captions.isdisjoint(train_captions)
    assert all(sd._is_validation_content(sd.make_scene(s)) == (s in sd.VALIDATION_SEEDS) for s in SEEDS)
    assert len(train_captions) < 3000, "expected some repeated small scenes in training, to make the check bite"


def test_every_task_appears_in_both_splits():
    for split in sd.SPLITS:
        counts = Counter(e["task"] for e in sd.examples(split, 150))
        assert set(counts) == set(sd.TASKS), (split, counts)
    only = list(sd.examples("validation", 10, tasks=["text", "relation"]))
    assert len(only) == 10 and {e["task"] for e in only} <= {"text", "relation"}


# ---- answers true of their scene -------------------------------------------------------------------
def _check_answer(scene: sd.Scene, task: str, question: str, answer: str) -> None:
    shapes = scene.shapes
    kind = {sd._PLURAL[k]: k for k in sd.KINDS}
    if task == "caption":
        assert answer == sd.caption(scene)
    elif task == "text":
        assert answer == " ".join(scene.words) and scene.words
    elif task == "count":
        m = re.fullmatch(r"How many (?:(\w+) shapes|(\w+))\?", question)
        word = m.group(1) or m.group(2) if m else None
        if question == "How many shapes are there?":
            expected = len(shapes)
        elif word in sd.COLOURS:
            expected = sum(s.colour == word for s in shapes)
        elif word in sd.SIZES:
            expected = sum(s.size == word for s in shapes)
        else:
            expected = sum(s.kind == kind[word] for s in shapes)
        assert answer == str(expected)
    elif task in ("colour", "position"):
        m = re.fullmatch(r"(?:What colour|Where) is the (\w+)(?: shape)?\?", question)
        by_colour = question.endswith(" shape?")  # "Where is the red shape?"
        named = [s for s in shapes if (s.colour if by_colour else s.kind) == m.group(1)]
        assert len(named) == 1, f"ambiguous question {question!r}"
        assert answer == (named[0].colour if task == "colour" else sd.POSITIONS[named[0].cell])
    elif task == "relation":
        m = re.fullmatch(r"Is the (\w+) (left of|above) the (\w+)\?", question)
        a, b = ([s for s in shapes if s.kind == m.group(i)] for i in (1, 3))
        assert len(a) == len(b) == 1, f"ambiguous question {question!r}"
        axis = (lambda s: s.cell % 3) if m.group(2) == "left of" else (lambda s: s.cell // 3)
        assert axis(a[0]) != axis(b[0])
        assert answer == ("yes" if axis(a[0]) < axis(b[0]) else "no")
    else:
        raise AssertionError(f"unknown task {task!r}")


def test_answers_are_true_of_the_scene():
    relation_answers = Counter()
    for seed in SEEDS:
        scene = sd.make_scene(seed)
        for task, question, answer in sd.qa_pairs(scene):
            _check_answer(scene, task, question, answer)
            if task == "relation":
                relation_answers[answer] += 1
    assert relation_answers["yes"] == relation_answers["no"] > 0


def test_answers_of_a_hand_built_scene():
    shapes = [sd.Shape("circle", "red", "large", 0), sd.Shape("square", "red", "small", 5),
              sd.Shape("square", "blue", "small", 8)]
    with pytest.raises(ValueError, match="text row 0"):
        sd.Scene(shapes, ("fox",), text_row=0)  # the circle is in row 0
    scene = sd.Scene(shapes[1:], ("fox", "owl"), text_row=0, seed=3)
    qa = {q: a for _, q, a in sd.qa_pairs(scene)}
    assert sd.caption(scene) == ('2 shapes: a small red square at the right and a small blue square at the bottom '
                                 'right. The text says "fox owl".')
    assert qa["How many squares?"] == "2" and qa["How many red shapes?"] == "1"
    assert qa["Where is the red shape?"] == "right" and qa["What does the text say?"] == "fox owl"
    assert "What colour is the square?" not in qa, "two squares: the question would be ambiguous"
    assert sum(a == "0" for a in qa.values()) == 2, "one absent colour and one absent kind"


# ---- rendering -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [48, 64, 96, 160])
def test_image_size_and_mode(size):
    for seed in (1, 100_001):
        image = sd.render(sd.make_scene(seed), size)
        assert image.size == (size, size) and image.mode == "RGB"
    assert next(sd.examples("validation", 1, size=size))["image"].size == (size, size)


def _assert_apart(scene: sd.Scene) -> None:
    """At size 96 (cells of 32 px) nothing is anti-aliased: every pixel is its cell's shape colour, text or black."""
    px = sd.render(scene, 96).load()
    owner = {s.cell: sd.COLOURS[s.colour] for s in scene.shapes}
    for y in range(96):
        for x in range(96):
            rgb = px[x, y]
            if rgb == (0, 0, 0):
                continue
            if scene.words and y // 32 == scene.text_row:
                assert rgb == (255, 255, 255), f"pixel ({x}, {y}) {rgb} in the text row of {scene}"
            else:
                assert rgb == owner.get((y // 32) * 3 + x // 32), f"pixel ({x}, {y}) {rgb} outside its cell: {scene}"


@pytest.mark.parametrize("n", range(1, 7))
def test_renders_one_to_six_shapes(n):
    cells = [c for c in range(9) if c // 3 != 1][:n]
    # Every kind, colour and size, pushed as far from the cell's centre as a shape may go.
    shapes = []
    for i, cell in enumerate(cells):
        size = sd.SIZES[(i + n) % 2]
        most = 0.5 - sd._RADIUS[size] - sd._MARGIN
        shapes.append(sd.Shape(sd.KINDS[i % 4], list(sd.COLOURS)[(i + n) % 6], size, cell,
                               (most * (-1) ** i, most * (-1) ** (i // 2))))
    scene = sd.Scene(shapes, ("garden", "rabbit"), text_row=1)  # the widest text there is: 13 characters
    for size in (48, 96):
        image = sd.render(scene, size)
        colours = {rgb for _, rgb in image.getcolors(size * size)}
        assert {sd.COLOURS[s.colour] for s in shapes} <= colours and (255, 255, 255) in colours
    _assert_apart(scene)


def test_generated_shapes_stay_in_their_cells_and_text_in_its_row():
    for seed in SEEDS[::2]:
        _assert_apart(sd.make_scene(seed))


def test_bad_scenes_and_arguments_are_refused():
    with pytest.raises(ValueError, match="kind='hexagon'"):
        sd.Shape("hexagon", "red", "small", 0)
    with pytest.raises(ValueError, match="offset"):
        sd.Shape("circle", "red", "large", 0, (0.2, 0.0))
    with pytest.raises(ValueError, match="share a cell"):
        sd.Scene([sd.Shape("circle", "red", "large", 0), sd.Shape("star", "red", "large", 0)])
    with pytest.raises(ValueError, match="1-6 shapes"):
        sd.Scene([])
    with pytest.raises(ValueError, match="split='test'"):
        sd.examples("test", 1)
    with pytest.raises(ValueError, match="tasks"):
        sd.examples("train", 1, tasks=["ocr"])
    with pytest.raises(ValueError, match="n=100001"):
        sd.examples("validation", 100_001)
    with pytest.raises(ValueError, match="size=16"):
        sd.render(sd.make_scene(0), 16)
    with pytest.raises(ValueError, match="seed=-1"):
        sd.make_scene(-1)


def test_word_list():
    assert len(set(sd.WORDS)) == len(sd.WORDS) >= 50
    assert all(re.fullmatch(r"[a-z]{3,6}", w) for w in sd.WORDS)
    reserved = set(sd.KINDS) | set(sd.COLOURS) | set(sd.SIZES) | {w for p in sd.POSITIONS for w in p.split()}
    assert reserved.isdisjoint(sd.WORDS) and set(sd._NUMBER_WORDS).isdisjoint(sd.WORDS)


# ---- files and grading ---------------------------------------------------------------------------------
def test_to_jsonl_writes_loadable_rows(tmp_path):
    path = sd.to_jsonl("validation", 6, tmp_path / "scenes", size=64)
    assert path == tmp_path / "scenes" / "validation.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    expected = list(sd.examples("validation", 6, size=64))
    assert len(rows) == 6
    for row, ex in zip(rows, expected):
        image = Image.open(path.parent / row["images"][0])
        assert image.size == (64, 64) and image.mode == "RGB"
        assert image.tobytes() == ex["image"].tobytes()
        user, assistant = row["messages"]
        assert user == {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ex["prompt"]}]}
        assert assistant == {"role": "assistant", "content": ex["answer"]}
        assert (row["task"], row["seed"]) == (ex["task"], ex["seed"])


def test_score_normalises_and_accuracy_reports_per_task():
    assert sd.score("position", " Top-Left. ", "top left")
    assert sd.score("position", "Centre", "center")
    assert sd.score("count", "Three", "3") and sd.score("count", "3.", "3")
    assert sd.score("colour", "RED", "red") and sd.score("text", "fox  owl", "fox owl")
    assert sd.score("caption", '1 shape: a small red star at the top. The text says "fox".',
                    '1 Shape: a small red star at the top. the text says fox')
    assert not sd.score("colour", "orange", "red") and not sd.score("count", "13", "3")
    assert not sd.score("text", "fox", "fox owl") and not sd.score("position", "top", "top left")
    with pytest.raises(ValueError, match="task='ocr'"):
        sd.score("ocr", "a", "a")
    acc = sd.accuracy([("count", "3", "3"), ("count", "2", "3"), ("text", "fox", "fox")])
    assert acc == {"count": 0.5, "text": 1.0, "all": 2 / 3}
