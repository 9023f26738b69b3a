"""profile=True: the cycle's phases timed on the device (CUDA events; the host's clock on a CPU) into
stats.device_time, without changing what the call decodes."""
from __future__ import annotations

import pytest
import torch

import eagle_mm as em
from eagle_mm.decode.state import PHASES, PhaseClock
from tests.tiny import prompt, tiny_model

TREE = em.TreeConfig(depth=3, top_k=2, total_tokens=6)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a CUDA GPU")


@pytest.fixture(scope="module")
def model_and_head():
    model = tiny_model("llama")
    return model, em.Eagle3Head.from_target(model)


def _call(model, head, device="cpu", **kw):
    model, head = model.to(device), head.to(device)
    return em.speculative_generate(model, head, prompt(10, batch=2).to(device), max_new_tokens=24,
                                   return_dict_in_generate=True, **kw)


def _check_phases(out, tree):
    s = out.stats
    assert set(s.device_time) == set(PHASES)
    cycles = s.time_draft + s.time_verify + s.time_other  # the cycles' wall time on the host
    for phase in ("verify", "accept", "update"):
        assert s.device_time[phase] > 0, (phase, s.device_time)
    assert (s.device_time["draft"] > 0) == tree.drafts
    assert sum(s.device_time.values()) <= cycles * 1.05 + 1e-3, (s.device_time, cycles)


@pytest.mark.parametrize("tree", [TREE, em.TreeConfig.none()], ids=["tree", "no-tree"])
def test_profile_times_each_phase_and_decodes_the_same(model_and_head, tree):
    model, head = model_and_head
    plain = _call(model, head, tree=tree)
    timed = _call(model, head, tree=tree, profile=True)
    assert plain.stats.device_time is None
    assert torch.equal(plain.sequences, timed.sequences)
    _check_phases(timed, tree)
    assert timed.stats.as_dict()["device_time"] == timed.stats.device_time


def test_profile_must_be_a_bool(model_and_head):
    model, head = model_and_head
    with pytest.raises(TypeError, match="profile must be True or False, got 'yes'"):
        _call(model, head, tree=TREE, profile="yes")


def test_spans_between_a_begin_and_the_next_mark_are_the_hosts():
    clock = PhaseClock(torch.device("cpu"))
    clock._spans = [(None, 0.0), ("verify", 1.0), ("accept", 1.5), ("update", 2.0), ("draft", 2.25),
                    (None, 5.0), ("verify", 6.0), ("accept", 6.5), ("update", 7.0)]
    assert clock.totals() == {"draft": 0.25, "verify": 2.0, "accept": 1.0, "update": 1.0}  # 2.25 -> 5.0: the host's


@cuda
def test_profile_on_cuda_times_the_device(model_and_head):
    model, head = model_and_head
    out = _call(model, head, device="cuda", tree=TREE, profile=True)
    _check_phases(out, TREE)
