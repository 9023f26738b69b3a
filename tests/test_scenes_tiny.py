"""scenes-tiny: the --toy build end to end, loading it, the image_embeds ablation flag, lossless speculative decoding
with both heads, the bench script, and the shipped model when it is there."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import eagle_mm as em
from eagle_mm import zoo
from eagle_mm.config import Eagle3Config
from eagle_mm.hf.parts import resolve_target
from eagle_mm.zoo import scenes_data as sd
from eagle_mm.zoo.scenes_tiny import HEADS, build, toy_config

SHIPPED = Path(zoo.__file__).resolve().parent / "models" / "scenes-tiny"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(zoo root holding scenes-tiny/, the build's manifest)."""
    root = tmp_path_factory.mktemp("zoo")
    manifest = build(root / "scenes-tiny", seed=0, toy=True, device="cpu")
    return root, manifest


@pytest.fixture(scope="module")
def loaded(built):
    return zoo.load_scenes_dir(built[0] / "scenes-tiny", device="cpu")


def _inputs(zm, seed: int, question: str = "Describe the image."):
    return zm.inputs(sd.render(sd.make_scene(seed), zm.image_size), question)


def test_toy_build_writes_every_part_and_measures_it(built):
    root, manifest = built
    out = root / "scenes-tiny"
    assert manifest["complete"] and manifest["name"] == "scenes-tiny" and manifest["toy"]
    assert manifest["stage_devices"] == {"base": "cpu", "heads": "cpu"}  # where and with what each stage ran
    assert set(manifest["stage_versions"]) == {"base", "heads"} and "torch" in manifest["stage_versions"]["base"]
    for part in ("target", *HEADS):
        assert (out / part / "config.json").is_file(), part
    assert (out / "target" / "processor_config.json").is_file() and (out / "target" / "tokenizer.json").is_file()
    assert not (out / ".work").exists()  # scratch files are gone: the directory is what ships
    accuracy = manifest["target"]["validation"]["accuracy"]
    assert "all" in accuracy and set(accuracy) - {"all"} <= set(sd.TASKS)
    assert manifest["target"]["training"]["steps"] == toy_config().training.max_steps
    assert manifest["total_bytes"] == sum(manifest["files"].values())
    for name, flags in HEADS.items():
        saved = json.loads((out / name / "config.json").read_text())
        for flag in ("image_embeds", "image_features"):
            assert manifest[name][flag] is flags.get(flag, True) and manifest[name]["steps"] > 0
            assert saved.get(flag, True) is flags.get(flag, True)


def test_zoo_load_finds_a_build_by_name(built, monkeypatch):
    monkeypatch.setenv(zoo.ZOO_ENV, str(built[0]))
    assert zoo.is_available("scenes-tiny")
    zm = zoo.load("scenes-tiny", device="cpu")
    assert isinstance(zm, zoo.ScenesModel) and zm.name == "scenes-tiny"
    assert type(zm.target).__name__ == "LlavaForConditionalGeneration"
    assert zm.head.config.image_embeds and not zm.ablation_head.config.image_embeds
    assert zm.ablation_head.config.image_features and not zm.blind_head.config.image_features
    assert zm.image_size == toy_config().shape.image_size


def test_image_embeds_round_trips_and_official_layouts_stay_as_they_were():
    cfg = Eagle3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=100, image_embeds=False)
    assert cfg.to_dict()["image_embeds"] is False
    assert Eagle3Config.from_dict(cfg.to_dict()).image_embeds is False
    assert "image_embeds" not in cfg.replace(image_embeds=True).to_dict()
    with pytest.raises(ValueError, match="image_embeds must be a bool, got 'no'"):
        cfg.replace(image_embeds="no")
    blind = cfg.replace(image_features=False)
    assert blind.to_dict()["image_features"] is False and "image_features" not in cfg.to_dict()
    assert Eagle3Config.from_dict(blind.to_dict()).image_features is False
    with pytest.raises(ValueError, match="image_features must be a bool, got 0"):
        cfg.replace(image_features=0)


def _spy_head_entries(monkeypatch, arg: str) -> list:
    """Record the ``arg`` ("hidden" or "embeds") of every call of the prefill's head_entries, in
    order."""
    import eagle_mm.decode.prefill as gen

    seen, real = [], gen.head_entries

    def spy(head, cache, hidden, tokens, pos, embeds=None, **kw):
        seen.append({"hidden": hidden, "embeds": embeds}[arg])
        return real(head, cache, hidden, tokens, pos, embeds=embeds, **kw)

    monkeypatch.setattr(gen, "head_entries", spy)
    return seen


def test_the_ablation_hides_the_image_from_the_draft(loaded, monkeypatch):
    """At the prefill the image-aware head gets the merged embeddings (image features at image positions); the
    ablation gets none, so it embeds the placeholder tokens itself."""
    seen = _spy_head_entries(monkeypatch, "embeds")
    zm = loaded
    inputs = _inputs(zm, 0)
    image = inputs["input_ids"][0, 1:] == zm.target.config.image_token_id  # head entry t reads token t+1
    for head, sees in ((zm.head, True), (zm.ablation_head, False)):
        seen.clear()
        em.speculative_generate(zm.target, head, **inputs, max_new_tokens=3, tree=zm.demo_tree())  # a tree: the head runs
        assert head.reads_images(resolve_target(zm.target)) is sees
        if sees:
            shown = seen[0][0, :-1]  # (T-1, H): the prompt's entries, without the first new token
            own = head.embed(inputs["input_ids"][:, 1:])[0]
            assert not torch.allclose(shown[image], own[image])
            torch.testing.assert_close(shown[~image], own[~image])
        else:
            assert seen[0] is None


def test_the_blind_ablation_zeroes_the_image_positions_features(loaded, monkeypatch):
    """eagle3-blind reads zeros where the prompt holds image tokens, and the target's features elsewhere."""
    seen = _spy_head_entries(monkeypatch, "hidden")
    zm = loaded
    inputs = _inputs(zm, 0)
    image = inputs["input_ids"][0] == zm.target.config.image_token_id  # feature t sits at position t
    got = {}
    for name, head in (("noimage", zm.ablation_head), ("blind", zm.blind_head)):
        seen.clear()
        em.speculative_generate(zm.target, head, **inputs, max_new_tokens=3, tree=zm.demo_tree())  # a tree: the head runs
        got[name] = seen[0][0]  # (T, F): the prefill's features
    assert image.any() and got["noimage"][image].abs().sum() > 0
    assert (got["blind"][image] == 0).all()
    torch.testing.assert_close(got["blind"][~image], got["noimage"][~image])


def test_hide_image_features_names_bad_input():
    from eagle_mm.hf.multimodal import hide_image_features

    feats = torch.ones(1, 4, 6)
    ids = torch.tensor([[1, 9, 9, 2]])
    assert hide_image_features(feats, ids, 9)[0, :, 0].tolist() == [1, 0, 0, 1]
    with pytest.raises(ValueError, match="needs a vision-language target with an image token id"):
        hide_image_features(feats, ids, None)
    with pytest.raises(ValueError, match=r"features \(1, 3, 6\) do not align with input_ids \(1, 4\)"):
        hide_image_features(feats[:, :3], ids, 9)


def test_the_trainer_hides_the_image_when_asked(built, loaded):
    from eagle_mm.train import TrainConfig
    from eagle_mm.train.data import encode_rows
    from eagle_mm.train.loop import _batch

    zm = loaded
    image = sd.render(sd.make_scene(3), zm.image_size)
    path = built[0] / "pic.png"
    image.save(path)
    row = {"images": [str(path)], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Describe the image."}, {"type": "image"}]},
        {"role": "assistant", "content": "1 shape."}]}
    examples = encode_rows(zm.tokenizer, [(1, row)], 256, processor=zm.processor)
    base = TrainConfig(target=str(built[0] / "scenes-tiny" / "target"), data=str(path), output_dir=str(built[0]))
    with_image = _batch(examples, zm.target, (1, 2, 3), base, torch.device("cpu"))
    hidden = _batch(examples, zm.target, (1, 2, 3), base.replace(image_embeds=False), torch.device("cpu"))
    assert "embeds" in with_image and "embeds" not in hidden
    torch.testing.assert_close(with_image["features"], hidden["features"])
    blind = _batch(examples, zm.target, (1, 2, 3), base.replace(image_embeds=False, image_features=False),
                   torch.device("cpu"))
    image = blind["input_ids"] == zm.target.config.image_token_id
    assert image.any() and (blind["features"][image] == 0).all() and with_image["features"][image].abs().sum() > 0
    torch.testing.assert_close(blind["features"][~image], hidden["features"][~image])


@pytest.mark.parametrize("tree", [None, em.TreeConfig.chain(3)], ids=["tree", "chain"])
def test_speculative_greedy_equals_generate_with_every_head(loaded, tree):
    zm = loaded
    for seed, question in ((0, "Describe the image."), (7, "How many shapes are there?")):
        inputs = _inputs(zm, seed, question)
        with torch.no_grad():
            ref = zm.target.generate(**inputs, max_new_tokens=12, do_sample=False)
            for head in (zm.head, zm.ablation_head, zm.blind_head):
                out = em.speculative_generate(zm.target, head, **inputs, tree=tree, max_new_tokens=12,
                                              return_dict_in_generate=True)
                assert torch.equal(out.sequences, ref)
                assert out.stats.mean_accept_length >= 1.0


def test_image_demo_reports_acceptance_and_speed(built):
    from eagle_mm.zoo.scenes_tiny import image_demo

    report = image_demo(path=built[0] / "scenes-tiny", device="cpu", max_new_tokens=8)
    assert report["identical"] and report["mean_accept_length"] >= 1.0 and report["speedup"] > 0
    assert isinstance(report["completion"], str) and report["question"] == "Describe the image."


def test_bench_script_runs_on_the_toy_build(built, tmp_path):
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "bench" / "bench_scenes_tiny.py"
    spec = importlib.util.spec_from_file_location("bench_scenes_tiny", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--path", str(built[0] / "scenes-tiny"), "--device", "cpu", "--examples", "2",
                       "--max-new-tokens", "6", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == set(bench.METHODS)
    for method in bench.METHODS[1:]:
        r = results[method]
        assert r["identical"] is True and r["mean_accept_length"] >= 1.0 and r["speedup"] > 0
        assert r["first_cycles_tokens_per_cycle"] is not None


@pytest.mark.skipif(not (SHIPPED / "manifest.json").is_file(),
                    reason="eagle_mm/zoo/models/scenes-tiny is not built into this checkout yet")
def test_the_shipped_scenes_tiny_decodes_losslessly(monkeypatch):
    monkeypatch.delenv(zoo.ZOO_ENV, raising=False)
    zm = zoo.load("scenes-tiny", device="cpu")
    assert zm.manifest["complete"] and not zm.manifest["toy"]
    for seed, question in ((0, "Describe the image."), (1, "What does the text say?")):
        inputs = _inputs(zm, seed, question)
        with torch.no_grad():
            ref = zm.target.generate(**inputs, max_new_tokens=48, do_sample=False)
            for head in (zm.head, zm.ablation_head, zm.blind_head):
                out = em.speculative_generate(zm.target, head, **inputs, max_new_tokens=48,
                                              tree=zm.demo_tree(), return_dict_in_generate=True)
                assert torch.equal(out.sequences, ref)
