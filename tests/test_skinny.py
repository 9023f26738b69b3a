"""skinny_linears: few-row CPU linears as W @ x^T, scoped to a block, the same values as F.linear."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagle_mm.decode import skinny
from eagle_mm.decode.skinny import skinny_linears


class _Sub(nn.Linear):  # a subclass (quantized and adapter layers are): keeps its own forward
    pass


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False), _Sub(8, 4))


@pytest.mark.parametrize("shape", [(1, 16), (3, 16), (2, 5, 16), (4, 1, 16), (200, 16)])
def test_same_values_as_linear(shape):
    net = _net()
    x = torch.randn(*shape)
    want = net(x)
    with skinny_linears(net):
        got = net(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_few_row_path_is_taken_and_undone(monkeypatch):
    net = _net()
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(skinny.torch, "mm", lambda a, b: calls.append(tuple(a.shape)) or real_mm(a, b))
    with skinny_linears(net):
        assert all("forward" in m.__dict__ for m in net[:3] if type(m) is nn.Linear)
        assert "forward" not in net[3].__dict__  # the subclass keeps its own
        net(torch.randn(4, 16))
        assert calls == [(32, 16), (8, 32)]  # both plain linears as W @ x^T
        calls.clear()
        net(torch.randn(1, 16))  # one row: F.linear
        net(torch.randn(skinny.MAX_ROWS + 1, 16))  # many rows: F.linear
        net.double()(torch.randn(4, 16, dtype=torch.float64))  # not fp32: F.linear
        assert calls == []
    assert not any("forward" in m.__dict__ for m in net.modules())


def test_leaves_instance_hooks_alone_and_nests():
    net = _net()
    hooked = net[0]
    hooked.forward = lambda x: F.linear(x, hooked.weight, hooked.bias)  # e.g. accelerate's hook
    mine = hooked.forward
    with skinny_linears(net):
        assert hooked.forward is mine
        with skinny_linears(net):
            inner = net[2].forward
        assert net[2].forward is inner  # still replaced: the outer block uses it
    assert hooked.forward is mine and "forward" not in net[2].__dict__


def test_concurrent_blocks_share_one_replacement():
    net = _net()
    inside, release = threading.Barrier(2), threading.Event()

    def decode():
        with skinny_linears(net):
            inside.wait()
            release.wait()

    workers = [threading.Thread(target=decode) for _ in range(2)]
    for w in workers:
        w.start()
    release.set()
    for w in workers:
        w.join()
    assert not any("forward" in m.__dict__ for m in net.modules())


def test_the_default_cpu_call_uses_it_and_gives_generates_tokens(monkeypatch):
    import eagle_mm as em
    from tests.tiny import prompt, tiny_model

    model = tiny_model("llama")
    head = em.Eagle3Head.from_target(model)
    ids = prompt(10)
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    rows = []
    real = skinny._forward
    monkeypatch.setattr(skinny, "_forward", lambda m, x: rows.append(x.numel() // x.shape[-1]) or real(m, x))
    out = em.speculative_generate(model, head, ids, max_new_tokens=12, do_sample=False, tree=em.TreeConfig.chain(3))
    assert torch.equal(out, ref)
    assert any(2 <= r <= skinny.MAX_ROWS for r in rows)  # the verify's few rows went through W @ x^T
    assert not any("forward" in m.__dict__ for m in (*model.modules(), *head.modules()))  # given back


def test_output_is_laid_out_as_linears():
    """Models view their projections (Llama 4's rotary calls view_as_complex): the last stride must be 1."""
    net = _net()
    with skinny_linears(net):
        y = net[0](torch.randn(2, 3, 16))
    assert y.is_contiguous() and y.shape == (2, 3, 32)
