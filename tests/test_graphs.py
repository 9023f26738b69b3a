"""eagle_mm.decode.graphs.OwnGraph: the signature rules (CPU), and capture and replay against the uncaptured function
(CUDA only)."""
import dataclasses
import gc

import pytest
import torch

from eagle_mm.decode.graphs import OwnGraph
from eagle_mm.decode.signature import Signature as _Signature


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str


class Thing:
    pass


@dataclasses.dataclass(frozen=True, eq=False)
class State:
    """Like the storage's Target and Buffers: frozen, compared by identity, holding static tensors."""

    buf: torch.Tensor


def _static(t):
    torch._dynamo.mark_static_address(t)
    return t


def test_signature_rules():
    buf, x = _static(torch.zeros(4)), torch.ones(4)
    thing, other = Thing(), Thing()
    a = _Signature((buf, x, [Kind("full")], thing, 3, "s", object()), frozenset({6}))
    b = _Signature((buf, torch.zeros(4), [Kind("full")], thing, 3, "s", object()), frozenset({6}))
    assert a.key == b.key  # a transient tensor by shape only, a frozen dataclass by value, the unkeyed arg ignored
    assert a.transient[0] is x and len(a.transient) == 1 and len(a.refs) == 1
    for changed in ((_static(torch.zeros(4)), x, [Kind("full")], thing, 3, "s", None),  # another static buffer
                    (buf, torch.ones(5), [Kind("full")], thing, 3, "s", None),  # another shape
                    (buf, x, [Kind("sliding")], thing, 3, "s", None),  # another value
                    (buf, x, [Kind("full")], other, 3, "s", None),  # another object
                    (buf, x, [Kind("full")], thing, 4, "s", None)):
        assert _Signature(changed, frozenset({6})).key != a.key


def test_signature_keys_an_identity_dataclass_as_itself():
    """A frozen dataclass compared by identity is keyed as the object it is, its tensors not looked at: the same
    object, the same key; another object over the same tensor, another key."""
    buf = _static(torch.zeros(4))
    state = State(buf)
    a, b = _Signature((state, 2), frozenset()), _Signature((state, 2), frozenset())
    assert a.key == b.key and not a.transient and a.device is None
    assert _Signature((State(buf), 2), frozenset()).key != a.key


def test_signature_holds_what_has_no_weak_reference():
    table = {"a": 1}
    sig = _Signature((table,), frozenset())
    assert sig.key == (("id", id(table)),) and sig.refs[0]() is table


def test_signature_keeps_aliases():
    x, y = torch.ones(3), torch.ones(3)
    same, apart = _Signature((x, x), frozenset()), _Signature((x, y), frozenset())
    assert same.key != apart.key and len(same.transient) == 1 and len(apart.transient) == 2


def test_cpu_calls_run_the_function():
    calls = []

    def fn(x, buf):
        calls.append(1)
        buf.add_(x)
        return buf * 2

    g, buf = OwnGraph(fn, "fn"), _static(torch.zeros(3))
    for i in range(3):
        out = g(torch.ones(3), buf)
    assert len(calls) == 3 and g.captures == 0 and torch.equal(out, torch.full((3,), 6.0))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


@cuda
def test_replay_matches_the_function():
    """Warm-up, capture, replays: static buffers are written in place, transient inputs are read afresh, and the
    result matches running the function at every call."""
    calls = []

    def fn(x, buf, scale: int, thing):
        calls.append(1)
        buf.add_(x * scale)
        return buf.sum(), x + 1

    g, thing = OwnGraph(fn, "fn", unkeyed=(3,)), Thing()
    buf, ref = _static(torch.zeros(5, device="cuda")), torch.zeros(5, device="cuda")
    for i in range(6):
        x = torch.arange(5.0, device="cuda") * (i + 1)
        total, y = g(x, buf, 2, Thing() if i % 2 else thing)  # the unkeyed object changes freely
        ref += x * 2
        assert torch.equal(buf, ref) and total.item() == ref.sum().item() and torch.equal(y, x + 1)
    assert len(calls) == 2 and g.captures == 1  # ran at the warm-up and the capture only
    g(torch.ones(5, device="cuda"), buf, 3, thing)  # another constant: a new signature, run again
    assert len(calls) == 3 and g.captures == 1
    buf2 = _static(torch.zeros(5, device="cuda"))
    for _ in range(3):
        g(torch.ones(5, device="cuda"), buf2, 2, thing)
    assert g.captures == 2 and torch.equal(buf2, torch.full((5,), 6.0, device="cuda"))


@cuda
def test_undo_captures_a_new_signature_in_its_first_call():
    """With ``undo`` a new signature is warmed up, restored and captured in one call: its effect happens once, and
    the next call replays; without it the capture waits for the second call."""
    from eagle_mm.decode.graphs import nothing_to_undo

    calls = []

    def fn(x, buf):
        calls.append(1)
        buf.add_(x)
        return buf * 2

    def undo(buf):
        saved = buf.clone()
        return lambda: buf.copy_(saved)

    g, buf = OwnGraph(fn, "fn"), _static(torch.zeros(4, device="cuda"))
    out = g(torch.ones(4, device="cuda"), buf, undo=lambda: undo(buf))
    assert g.captures == 1 and len(calls) == 2 and torch.equal(buf, torch.ones(4, device="cuda"))
    assert torch.equal(out, torch.full((4,), 2.0, device="cuda"))
    g(torch.ones(4, device="cuda"), buf, undo=lambda: undo(buf))  # a replay: no snapshot, no run
    assert g.captures == 1 and len(calls) == 2 and torch.equal(buf, torch.full((4,), 2.0, device="cuda"))
    pure = OwnGraph(lambda x: x + 1, "pure")
    assert torch.equal(pure(torch.ones(2, device="cuda"), undo=nothing_to_undo), torch.full((2,), 2.0, device="cuda"))
    assert pure.captures == 1


@cuda
def test_a_function_of_identity_keyed_state_is_captured_on_its_device():
    """No tensor argument but a state object keyed by identity: the graph runs on the device it was given, and
    captures and replays like any other."""
    calls = []

    def fn(state, k: int):
        calls.append(1)
        state.buf.add_(k)
        return state.buf * 2

    state = State(_static(torch.zeros(3, device="cuda")))
    g = OwnGraph(fn, "fn", device="cuda")
    for _ in range(4):
        out = g(state, 1)
    assert g.captures == 1 and len(calls) == 2 and torch.equal(out, torch.full((3,), 8.0, device="cuda"))
    assert OwnGraph(fn, "fn")(state, 1) is not None and len(calls) == 3  # no device: it just runs


@cuda
def test_an_aliased_argument_is_captured_as_one_tensor():
    """The same tensor passed twice is one buffer in the graph, as it was one tensor to the function (dynamo
    guards on aliasing: two clones would make it recompile inside the capture, which fails)."""
    fn = torch.compile(lambda a, b: a + b, dynamic=False)
    g = OwnGraph(fn, "fn")
    for i in range(4):
        x = torch.full((3,), float(i), device="cuda")
        assert torch.equal(g(x, x), 2 * x)
    assert g.captures == 1


@cuda
def test_a_dead_object_is_not_taken_for_a_new_one():
    def fn(x, thing):
        return x * thing.k

    g = OwnGraph(fn, "fn")
    for k in (2, 3):
        thing = Thing()
        thing.k = k
        for _ in range(3):
            out = g(torch.ones(2, device="cuda"), thing)
        assert torch.equal(out, torch.full((2,), float(k), device="cuda"))
        del thing
        gc.collect()


def test_captures_take_turns_and_leave_other_threads_work_legal(monkeypatch):
    """Two threads capturing at once (decoders of one model on one GPU) take turns, each capture in CUDA's
    "thread_local" mode (another thread's work meanwhile is neither refused nor captured). On a CPU: the capture
    context replaced by one that records how many captures are underway and the mode asked for."""
    import threading
    import time

    state = {"now": 0, "most": 0, "modes": []}

    class FakeCapture:
        def __init__(self, graph, capture_error_mode="global", **kw):
            state["modes"].append(capture_error_mode)

        def __enter__(self):
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            time.sleep(0.05)  # long enough for the other thread to arrive

        def __exit__(self, *exc):
            state["now"] -= 1

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    start = threading.Barrier(2)

    def capture():
        g = OwnGraph(lambda x: x + 1, "step")
        start.wait()
        g._capture((torch.ones(2),), _Signature((torch.ones(2),), frozenset()))

    threads = [threading.Thread(target=capture) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert state["modes"] == ["thread_local"] * 2 and state["most"] == 1


def test_a_runners_setup_never_falls_when_its_graphs_are_dropped():
    """A call reads what it spent capturing as the runner's setup after it less before it: dropping the graphs (new
    memory) must not make that negative, or a call that captured every step again passes for one that did not."""
    from eagle_mm.decode.runner import Runner

    class Spent:
        setup, captures = 0.7, 3

    r = Runner()
    r._wrapped[("verify", "graphs")] = Spent()
    before = r.setup
    r.reset()
    assert r.setup == before == 0.7 and not r._wrapped
    r._wrapped[("verify", "graphs")] = Spent()
    assert r.setup == pytest.approx(1.4)
