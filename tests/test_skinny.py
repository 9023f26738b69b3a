"""skinny_linears: few-row CPU linears as W @ x^T, in one thread, within a block; the same values as F.linear."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from eagle_mm.decode import skinny
from eagle_mm.decode.skinny import skinny_linears


class _Sub(nn.Linear):  # a subclass (quantized and adapter layers are) still calls F.linear
    pass


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False), _Sub(8, 4))


@pytest.mark.parametrize("shape", [(1, 16), (3, 16), (2, 5, 16), (4, 1, 16), (200, 16)])
def test_same_values_as_linear(shape):
    net = _net()
    x = torch.randn(*shape)
    want = net(x)
    with skinny_linears():
        got = net(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _spy_mm(monkeypatch) -> list:
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(skinny.torch, "mm", lambda a, b: calls.append((threading.get_ident(), tuple(a.shape)))
                        or real_mm(a, b))
    return calls


def test_the_few_row_path_is_taken_within_the_block_only(monkeypatch):
    net = _net()
    calls = _spy_mm(monkeypatch)
    with skinny_linears():
        net(torch.randn(4, 16))
        assert [shape for _, shape in calls] == [(32, 16), (8, 32), (4, 8)]  # every linear as W @ x^T
        calls.clear()
        net(torch.randn(1, 16))  # one row: F.linear
        net(torch.randn(skinny.MAX_ROWS + 1, 16))  # many rows: F.linear
        net.double()(torch.randn(4, 16, dtype=torch.float64))  # not fp32: F.linear
        assert calls == []
        net.float()
    net(torch.randn(4, 16))  # after the block: F.linear
    assert calls == []
    assert not any("forward" in vars(m) for m in net.modules())  # nothing was set on a module


def test_only_the_thread_in_the_block_is_affected(monkeypatch):
    """Another thread's forward, run while this one is in the block, takes F.linear: its values are bit for bit
    those of a forward with no block anywhere."""
    net = _net()
    x = torch.randn(4, 16)
    want = net(x)
    calls = _spy_mm(monkeypatch)
    inside, done, got = threading.Event(), threading.Event(), {}

    def other():
        inside.wait(30)
        got["out"] = net(x)
        done.set()

    worker = threading.Thread(target=other)
    worker.start()
    with skinny_linears():
        inside.set()
        assert done.wait(30)
        net(x)
    worker.join(30)
    assert torch.equal(got["out"], want)
    assert {ident for ident, _ in calls} == {threading.get_ident()}


def test_the_call_uses_it_where_measured_faster_and_gives_generates_tokens(monkeypatch):
    import eagle_mm as em
    from tests.tiny import prompt, tiny_model

    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model)
    ids = prompt(10)
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    rows = []
    real = skinny._linear
    monkeypatch.setattr(skinny, "_linear", lambda x, *a, **k: rows.append(x.numel() // x.shape[-1]) or real(x, *a, **k))
    out = em.speculative_generate(model, head, ids, max_new_tokens=12, do_sample=False)  # probes, then may draft
    assert torch.equal(out, ref)
    # A given tree where the probe timed the verify faster with it (a stand-in: this machine's verdict may differ).
    from eagle_mm.decode.costs import CycleCosts

    qs = (1, 2, 4, 8)
    em.decoder(model, head).chooser.entries = {"1/greedy": CycleCosts(
        1, tuple((q, 1e-3) for q in qs), ((1, 1e-6, 1e-6), (8, 1e-6, 1e-6)), ((2, 1e-6), (9, 1e-6)), 1e-6, qs)}
    rows.clear()
    out = em.speculative_generate(model, head, ids, max_new_tokens=12, do_sample=False, tree=em.TreeConfig.chain(3))
    assert torch.equal(out, ref)
    assert any(2 <= r <= skinny.MAX_ROWS for r in rows)  # the verify's few rows went through W @ x^T


def test_output_is_laid_out_as_linears():
    """Models view their projections (Llama 4's rotary calls view_as_complex): the last stride must be 1."""
    net = _net()
    with skinny_linears():
        y = net[0](torch.randn(2, 3, 16))
    assert y.is_contiguous() and y.shape == (2, 3, 32)


def test_another_threads_forward_is_untouched_during_a_call():
    """While a speculative call runs a verify forward (on a CPU, where it takes few-row linears as W @ x^T), a plain
    forward of the same model in another thread computes exactly what it computes with no call running, and no
    module of the model or head has anything set on it."""
    import eagle_mm as em
    from tests.tiny import prompt, tiny_model

    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model)
    other = prompt(7, seed=5)  # 7 rows through every linear: the few-row case
    with torch.no_grad():
        want = model(other).logits
    before = {name: dict(vars(m)) for name, m in (*model.named_modules(), *head.named_modules())}
    decoding, mid_call, forward_done, seen = threading.get_ident(), threading.Event(), threading.Event(), {}
    calls = []

    def meanwhile(module, args):  # in the decoding thread, inside its second forward: the first verify
        if threading.get_ident() == decoding:
            calls.append(1)
            if len(calls) == 2:
                seen["dicts"] = {name: dict(vars(m)) for name, m in (*model.named_modules(), *head.named_modules())}
                mid_call.set()
                assert forward_done.wait(60)

    def plain():
        assert mid_call.wait(60)
        with torch.no_grad():
            seen["got"] = model(other).logits
        forward_done.set()

    hook = model.model.layers[3].register_forward_pre_hook(meanwhile)
    worker = threading.Thread(target=plain)
    worker.start()
    try:
        em.speculative_generate(model, head, prompt(10), max_new_tokens=12, do_sample=False)
    finally:
        hook.remove()
        worker.join(60)
    assert torch.equal(seen["got"], want)
    assert seen["dicts"] == before
