"""Training end to end on a tiny target: learning, exact resume, atomic checkpoints, dumped features."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import eagle_mm as em
from eagle_mm.train import TrainConfig, dump_features, train
from eagle_mm.train.checkpoint import list_checkpoints
from eagle_mm.train.data import encode_rows, read_rows
from eagle_mm.train.evaluate import eval_prompts, mean_accept_length
from tests.test_train_tools import greedy_rows, one_thread, save_target, tiny_tokenizer, write_jsonl  # noqa: F401

ROWS, HOLDOUT = 72, 8


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    model = save_target(root / "target")
    data = write_jsonl(root / "data.jsonl", greedy_rows(model, ROWS))
    return {"root": root, "model": model, "target": str(root / "target"), "data": data}


def _config(work, out, **kw):
    base = dict(target=work["target"], data=work["data"], output_dir=str(work["root"] / out), batch_size=8,
                mixed_precision="no", save_dtype="float32", lr=3e-3, warmup_ratio=0.1, log_every=1000)
    return TrainConfig(**{**base, **kw})


def _weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


def _held_out_prompts(work):
    examples = encode_rows(tiny_tokenizer(), read_rows(work["data"]), max_length=2048)
    return eval_prompts(examples[-HOLDOUT:], HOLDOUT)


@pytest.mark.parametrize("kind, steps", [("eagle3", 100), ("eagle", 60)])
def test_training_lowers_the_loss_and_beats_a_fresh_head(work, kind, steps):
    cfg = _config(work, f"learn-{kind}", kind=kind, max_steps=steps, eval_holdout=HOLDOUT, eval_samples=HOLDOUT,
                  eval_max_new_tokens=24, save_every=1000)
    result = train(cfg)
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.9 * first, (first, last)
    model = work["model"]
    cls = em.Eagle3Head if kind == "eagle3" else em.EagleHead
    trained = cls.from_pretrained(cfg.output_dir, target=model)
    fresh = cls.from_target(model)
    prompts = _held_out_prompts(work)
    # The trainer's check drafts a fixed tree (TreeConfig.reference: a short chain on a CPU) ...
    assert mean_accept_length(model, trained, prompts, max_new_tokens=24) == pytest.approx(result.mean_accept_length)
    # ... and a wide tree shows more of what the head learnt.
    wide = em.TreeConfig()
    fresh_len = mean_accept_length(model, fresh, prompts, max_new_tokens=24, tree=wide)
    trained_len = mean_accept_length(model, trained, prompts, max_new_tokens=24, tree=wide)
    assert trained_len > fresh_len + 1.0, (fresh_len, trained_len)
    out = cfg.output_dir
    assert {"config.json", "model.safetensors", "train_config.json", "train_log.jsonl", "eval.json"} <= set(
        os.listdir(out))
    assert TrainConfig.load(os.path.join(out, "train_config.json")) == cfg


class _Crash(Exception):
    pass


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_kill_and_resume_matches_an_uninterrupted_run(work, kind):
    # EAGLE-1 draws feature noise from the RNG each step: resume must restore the RNG too.
    kw = dict(kind=kind, max_steps=7, batch_size=4, grad_accum=2, save_every=2)
    full = train(_config(work, f"full-{kind}", **kw))

    def crash_after_4(step, metrics):
        if step == 4:
            raise _Crash

    cut = _config(work, f"cut-{kind}", **kw)
    with pytest.raises(_Crash):
        train(cut, on_step=crash_after_4)
    assert [s for s, _ in list_checkpoints(cut.output_dir)] == [2, 4]
    resumed = train(cut.replace(resume="auto"))
    assert resumed.losses[0] == full.losses[4]  # step 5, bit for bit
    assert resumed.losses == full.losses[4:]
    a, b = _weights(full.output_dir), _weights(cut.output_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_another_config_and_writes_nothing(work):
    cfg = _config(work, "refuse", max_steps=4, save_every=2)
    train(cfg)
    out = cfg.output_dir
    before = {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
              for d, _, files in os.walk(out) for f in files}
    with pytest.raises(ValueError, match=r"training field 'lr' differs \(checkpoint: 0.003, now: 0.001\)"):
        train(cfg.replace(resume="auto", lr=1e-3))
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(cfg.replace(max_steps=6))
    ckpt = list_checkpoints(out)[-1][1]
    with pytest.raises(ValueError, match=r"training field 'ttt_steps' differs"):
        train(cfg.replace(resume=str(ckpt), ttt_steps=3))
    after = {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns for d, _, files in os.walk(out) for f in files}
    assert after == before


def test_a_crash_while_writing_a_checkpoint_keeps_the_last_good_one(work, monkeypatch):
    from accelerate import Accelerator

    real = Accelerator.save_state

    def dies_at_step_4(self, output_dir=None, **kw):
        if "step-00000004" in str(output_dir):
            with open(os.path.join(output_dir, "model.safetensors"), "wb") as f:
                f.write(b"half a file")
            raise _Crash
        return real(self, output_dir, **kw)

    cfg = _config(work, "atomic", max_steps=6, save_every=2)
    monkeypatch.setattr(Accelerator, "save_state", dies_at_step_4)
    with pytest.raises(_Crash):
        train(cfg)
    monkeypatch.setattr(Accelerator, "save_state", real)
    ((step, good),) = list_checkpoints(cfg.output_dir)
    assert step == 2 and em.Eagle3Head.from_pretrained(good / "head").config.draft_vocab_size > 0
    result = train(cfg.replace(resume="auto"))
    assert result.step == 6 and len(result.losses) == 4
    assert [s for s, _ in list_checkpoints(cfg.output_dir)] == [4, 6]
    assert not any(p.name.startswith(".tmp") for p in (good.parent).iterdir())


def test_a_time_limited_run_ends_its_schedule_when_the_time_is_spent(work, monkeypatch):
    import eagle_mm.train.schedule as schedule

    # A fake clock that each finished step moves on by one second: 20 seconds hold about 20 steps. The run stops
    # there with the learning rate at its floor (the schedule was fitted to the time, not cut short by it), far
    # below the 1000 steps that max_steps allows.
    now = [0.0]
    monkeypatch.setattr(schedule, "_clock", lambda: now[0])
    cfg = _config(work, "timed", max_steps=1000, max_seconds=20.0, min_lr_ratio=0.1, log_every=1, save_every=1000)
    lrs = []

    def tick(step, metrics):
        lrs.append(metrics["lr"])
        now[0] += 1.0

    result = train(cfg, on_step=tick)
    assert 19 <= result.step <= 22, result.step
    assert lrs[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio)
    assert max(lrs) > 0.9 * cfg.lr  # the warm-up and the peak happened within the time too
    assert [s for s, _ in list_checkpoints(cfg.output_dir)] == [result.step]
    with pytest.raises(ValueError, match=r"max_seconds must lie in \(0.0, inf\]; got 0"):
        cfg.replace(max_seconds=0)


def test_dumped_features_train_like_online_features(work):
    base = _config(work, "online", max_steps=5, save_every=1000)
    dump_dir = work["root"] / "dump"
    dump_features(base, dump_dir, shard_bytes=40_000)
    assert len(list(dump_dir.glob("shard-*.safetensors"))) > 1
    online = train(base)
    offline = train(base.replace(data=None, features_dir=str(dump_dir), output_dir=str(work["root"] / "offline")))
    assert offline.losses == pytest.approx(online.losses, rel=1e-4)
    a, b = _weights(online.output_dir), _weights(offline.output_dir)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"dumped with kind='eagle3'.*needs kind='eagle'"):
        train(base.replace(data=None, features_dir=str(dump_dir), kind="eagle",
                           output_dir=str(work["root"] / "offline-eagle")))


def test_train_config_validates_and_round_trips(tmp_path):
    cfg = TrainConfig(target="t", output_dir=str(tmp_path / "o"), data="d.jsonl", aux_layers=[1, 2, 3])
    assert cfg.target == os.path.abspath("t") and cfg.aux_layers == (1, 2, 3)
    cfg.save(tmp_path / "c.json")
    assert TrainConfig.load(tmp_path / "c.json") == cfg
    assert cfg.training_difference(cfg.replace(eval_samples=3, resume="auto")) is None
    assert cfg.training_difference(cfg.replace(seed=1)) == ("seed", 0, 1)
    for bad, match in [(dict(kind="medusa"), "kind must be one of"), (dict(lr=-1.0), "lr must lie in"),
                       (dict(features_dir="f"), "exactly one of data"), (dict(batch_size=0), "batch_size"),
                       (dict(aux_layers=(1, 2)), "aux_layers"), (dict(ttt_decay=0.0), "ttt_decay")]:
        with pytest.raises(ValueError, match=match):
            cfg.replace(**bad)
    with pytest.raises(ValueError, match=r"unknown TrainConfig field\(s\) \['epoch'\]"):
        TrainConfig.from_dict({**cfg.to_dict(), "epoch": 2})
