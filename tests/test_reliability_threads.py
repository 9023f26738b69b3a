"""Decoding state is per call: threads sharing one model and head get exactly their lone-run results."""
from __future__ import annotations

import threading

import pytest
import torch

import eagle_mm
from eagle_mm.hf.parts import resolve_target
from eagle_mm.hf.features import FeatureCapture
from eagle_mm.heads import Eagle3Head, EagleHead
from tests.tiny import prompt, tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def test_a_capture_sees_only_its_own_threads_forwards(target):
    """Thread A opens its capture, B opens its own and runs a forward, then A runs its: each sees only its own."""
    parts = resolve_target(target)
    ids = {"a": prompt(5, seed=1), "b": prompt(5, seed=2)}
    with torch.no_grad():
        ref = {k: target(v, output_hidden_states=True).hidden_states for k, v in ids.items()}
    opened, b_ran = threading.Barrier(2), threading.Event()
    got, errors = {}, []

    def run(name):
        try:
            with FeatureCapture(parts, (1, 3, 6)) as cap, torch.no_grad():
                opened.wait()
                if name == "a":
                    b_ran.wait()
                target(ids[name])
                if name == "b":
                    b_ran.set()
                    opened.wait()  # keep B's capture open until A has run its forward
                got[name] = cap.features()
                if name == "a":
                    opened.wait()
        except Exception as e:  # surfaced below with the thread's name
            errors.append((name, e))

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for k in ("a", "b"):
        torch.testing.assert_close(got[k], torch.cat([ref[k][i] for i in (1, 3, 6)], -1), rtol=0, atol=0, msg=k)


def _jobs():
    """(batch, do_sample, seed) of each thread: batch sizes 1 and 2, greedy and sampled, two of each."""
    return [(b, s, seed) for b in (1, 2) for s in (False, True) for seed in (0, 1)]


def _decode(target, head, batch, do_sample, seed):
    ids = prompt(6 + 3 * seed + batch, batch=batch, seed=10 + seed)
    gen = torch.Generator().manual_seed(seed) if do_sample else None
    # A given tree: the default call's is chosen from what earlier calls saw, which threads change the order of.
    out = eagle_mm.speculative_generate(target, head, ids, max_new_tokens=12, do_sample=do_sample, generator=gen,
                                        top_k=0, tree=eagle_mm.TreeConfig(depth=3, top_k=2, total_tokens=4),
                                        return_dict_in_generate=True)
    return out.sequences, out.stats.accept_counts, out.stats.accepted_tokens


@pytest.mark.parametrize("kind", [Eagle3Head, EagleHead])
def test_threads_give_lone_run_results_and_stats(target, kind):
    torch.manual_seed(5)
    head = kind.from_target(target)
    lone = [_decode(target, head, *job) for job in _jobs()]
    assert any(sum(counts) for _, counts, _ in lone), "no draft token accepted: the stats would not tell a mix"
    start = threading.Barrier(len(lone))
    results, errors = [None] * len(lone), []

    def run(i, job):
        try:
            start.wait()
            results[i] = _decode(target, head, *job)
        except Exception as e:  # reported below with the job
            errors.append((job, repr(e)))

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(_jobs())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for job, got, want in zip(_jobs(), results, lone):
        assert torch.equal(got[0], want[0]) and got[1:] == want[1:], f"job {job}: {got[1:]} vs lone {want[1:]}"


def _run_threads(jobs: list) -> list:
    """Run each job (a callable) in its own thread, all started together; their results, or the first error."""
    start = threading.Barrier(len(jobs))
    results, errors = [None] * len(jobs), []

    def run(i):
        try:
            start.wait()
            results[i] = jobs[i]()
        except Exception as e:  # reported below with the job
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return results


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=["fp32+fp32", "fp32+bf16"])
def test_two_models_sharing_one_head_in_two_threads(target, dtypes):
    """One head loaded once, used with a model and its copy (of another dtype too) in two threads at once: each call
    gives what it gives alone (fp32: generate()'s tokens; bf16 rounds a verify of several tokens otherwise)."""
    import copy

    models = [copy.deepcopy(target).to(d) for d in dtypes]
    head = Eagle3Head.from_target(target)
    # Per model: three calls, of the same shapes in both threads (the engine's buffers would be shared as they are).
    calls = [[(prompt(6 + i, batch=1 + i % 2, seed=20 + i + 4 * m), 24) for i in range(3)] for m in range(2)]

    def decode(m):
        return [eagle_mm.speculative_generate(models[m], head, ids, max_new_tokens=n, do_sample=False)
                for ids, n in calls[m]]

    want = [decode(0), decode(1)]
    assert all(torch.equal(out, models[0].generate(ids, max_new_tokens=n, do_sample=False))
               for out, (ids, n) in zip(want[0], calls[0]))
    got = _run_threads([lambda: decode(0), lambda: decode(1)])
    for m in range(2):
        for i in range(3):
            assert torch.equal(got[m][i], want[m][i]), (dtypes[m], i)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_two_heads_on_one_model_capture_in_two_threads_on_one_gpu():
    """Two decoders of one model (two heads) in two threads on one GPU, each call's first cycles capturing CUDA graphs
    while the other thread replays or captures: every call gives generate()'s tokens, and each head's decoder
    captured its own graphs."""
    model = tiny_model("llama").cuda()
    heads = [EagleHead.from_target(model).cuda(), Eagle3Head.from_target(model).cuda()]
    calls = [(prompt(7 + i, batch=1 + i % 2, seed=40 + i).cuda(), 20) for i in range(3)]
    want = [model.generate(ids, max_new_tokens=n, do_sample=False) for ids, n in calls]

    def decode(h):
        return [eagle_mm.speculative_generate(model, heads[h], ids, max_new_tokens=n, do_sample=False,
                                              tree=eagle_mm.TreeConfig(depth=4, top_k=3, total_tokens=8))
                for ids, n in calls]

    got = _run_threads([lambda: decode(0), lambda: decode(1)])
    for h in range(2):
        assert all(torch.equal(g, w) for g, w in zip(got[h], want)), h
        assert eagle_mm.decoder(model, heads[h]).runner.captures > 0
