"""Where the engine's time goes on the GPU: code-tiny greedy vs sampled (second calls), and the 8B cycle's kernels.

    PYTHONPATH=. python dev/gpu/profile_engine.py --out $OUT/profile   # writes text tables there
Part 1: code-tiny bf16, the default call (CUDA graphs), greedy and sampled: time, cycles, host phases, and the
top ops by self CPU time (what the host runs eagerly per cycle). Part 2: the 8B-shaped target with the forced head
at acceptance 4, the engine uncompiled and eager (cache_implementation="static", compile=False): the top kernels
by self CUDA time, i.e. what the captured graphs replay.
"""
import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))


def timed(call):
    """Two untimed calls (capture), then one timed: (its output, seconds)."""
    call()
    call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def profiled(call, path, n=45):
    """One more call under the profiler (CPU and CUDA, with stacks); its tables to ``path``."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        call()
        torch.cuda.synchronize()
    tables(prof, path, n)


def tables(prof, path, n=45):
    t = prof.key_averages()
    with open(path, "w") as f:
        f.write("== self CUDA ==\n" + t.table(sort_by="self_device_time_total", row_limit=n) + "\n")
        f.write("== self CPU ==\n" + t.table(sort_by="self_cpu_time_total", row_limit=n) + "\n")
        try:  # where the host copies (and waits) come from
            st = prof.key_averages(group_by_stack_n=6)
            f.write("== by stack ==\n" + st.table(sort_by="cpu_time_total", row_limit=30) + "\n")
        except Exception as e:  # noqa: BLE001
            f.write(f"no stacks: {e}\n")


def code_tiny(out):
    import eagle_mm
    from eagle_mm import zoo

    m = zoo.load("code-tiny", device="cuda")
    model, head = m.target, m.eagle3_head
    enc = m.tokenizer(["def fibonacci(n):"], return_tensors="pt").to("cuda")
    for name, kw in (("greedy", dict(do_sample=False)), ("sampled", dict(do_sample=True)),
                     ("sampled_t08", dict(do_sample=True, temperature=0.8, top_p=0.95))):
        def call():
            g = torch.Generator("cuda").manual_seed(0) if kw["do_sample"] else None
            return eagle_mm.speculative_generate(model, head, **enc, max_new_tokens=64, generator=g,
                                                 return_dict_in_generate=True, **kw)
        o, dt = timed(call)
        s = o.stats
        print(f"{name}: {dt:.4f}s new={o.sequences.shape[1] - enc.input_ids.shape[1]} "
              f"cycles={s.num_target_forwards} acc={s.mean_accept_length:.2f} draft={s.time_draft:.4f} "
              f"verify={s.time_verify:.4f} other={s.time_other:.4f} prefill={s.time_prefill:.4f} tree={s.tree}",
              flush=True)
        profiled(call, f"{out}_codetiny_{name}.txt")


def batch16(out):
    """code-tiny greedy, batch 16 of the shipped prompts, 128 new tokens with min_new_tokens, as bench_matrix."""
    import eagle_mm
    from eagle_mm import zoo

    m = zoo.load("code-tiny", device="cuda")
    model, head, tok = m.target, m.eagle3_head, m.tokenizer
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    enc = dict(tok((m.prompts * 16)[:16], return_tensors="pt", padding=True).to("cuda"))
    for name, kw in (("ours", {}), ("ours_chain3", dict(tree=eagle_mm.TreeConfig.chain(3)))):
        def call():
            return eagle_mm.speculative_generate(model, head, **enc, max_new_tokens=128, min_new_tokens=128,
                                                 do_sample=False, return_dict_in_generate=True, **kw)
        o, dt = timed(call)
        s = o.stats
        print(f"b16 {name}: {dt:.4f}s {16 * 128 / dt:.0f} tok/s cycles={s.num_target_forwards} "
              f"acc={s.mean_accept_length:.2f} draft={s.time_draft:.4f} verify={s.time_verify:.4f} "
              f"other={s.time_other:.4f} prefill={s.time_prefill:.4f} tree={s.tree}", flush=True)
        profiled(call, f"{out}_b16_{name}.txt")
    for name, kw in (("hf_static", dict(cache_implementation="static")), ("hf_eager", {})):
        _, dt = timed(lambda kw=kw: model.generate(**enc, max_new_tokens=128, min_new_tokens=128, do_sample=False,
                                                   **kw))
        print(f"b16 {name}: {16 * 128 / dt:.0f} tok/s", flush=True)


def batch64(out):
    """code-tiny greedy, batch 64, 96 new tokens as bench_matrix: no tree, the default call and HF static, each with
    its kernel count and device time per step (is a step bound by the GPU's kernels or by the host?)."""
    import eagle_mm
    from eagle_mm import zoo

    m = zoo.load("code-tiny", device="cuda")
    model, head, tok = m.target, m.eagle3_head, m.tokenizer
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    enc = dict(tok((m.prompts * 64)[:64], return_tensors="pt", padding=True).to("cuda"))
    n_new = 96
    calls = {
        "ours_none": lambda: eagle_mm.speculative_generate(model, head, **enc, max_new_tokens=n_new,
                                                           min_new_tokens=n_new, do_sample=False,
                                                           tree=eagle_mm.TreeConfig.none(),
                                                           return_dict_in_generate=True),
        "ours_default": lambda: eagle_mm.speculative_generate(model, head, **enc, max_new_tokens=n_new,
                                                              min_new_tokens=n_new, do_sample=False,
                                                              return_dict_in_generate=True),
        "hf_static": lambda: model.generate(**enc, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                            cache_implementation="static"),
    }
    for name, call in calls.items():
        o, dt = timed(call)
        s = getattr(o, "stats", None)
        steps = s.num_target_forwards if s is not None else n_new
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        ev = prof.key_averages()
        kernels = sum(e.count for e in ev if e.device_time_total > 0 and e.self_device_time_total > 0
                      and not e.key.startswith("cuda"))
        dev_us = sum(e.self_device_time_total for e in ev)
        print(f"b64 {name}: {dt * 1e3:.1f} ms {64 * n_new / dt:.0f} tok/s steps={steps} "
              f"per step {dt * 1e3 / steps:.3f} ms wall, {dev_us / 1e3 / steps:.3f} ms device, "
              f"{kernels / steps:.0f} kernels" + (f" tree={s.tree} draft={s.time_draft:.4f} verify={s.time_verify:.4f} "
                                                    f"other={s.time_other:.4f} prefill={s.time_prefill:.4f}"
                                                    if s is not None else ""), flush=True)
        tables(prof, f"{out}_b64_{name}.txt", 40)


def eight_b(out):
    import eagle_mm
    from bench_8b import build, fit_draft_vocab, parse_args
    from forced import ForcedHead

    args = parse_args(["--accept", "4"])
    target, head = build(args, torch.device("cuda"))
    ids = torch.randint(3, target.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)).cuda()
    ref = target.generate(ids, max_new_tokens=128, do_sample=False)
    reference = torch.cat((ref.cpu(), ref.new_zeros(1, 12).cpu()), 1).cuda()
    forced = ForcedHead(head, reference, draft_index=fit_draft_vocab(head, ref))
    forced.set_accept(4)
    tree = eagle_mm.TreeConfig(depth=5, top_k=8, total_tokens=32)
    for name, kw in (("eager_engine", dict(cache_implementation="static", compile=False)), ("graphs", {})):
        def call():
            return eagle_mm.speculative_generate(target, forced, ids, max_new_tokens=128, do_sample=False, tree=tree,
                                                 return_dict_in_generate=True, **kw)
        o, dt = timed(call)
        s = o.stats
        n = s.num_target_forwards
        print(f"8b {name}: {dt:.4f}s cycles={n} acc={s.mean_accept_length:.2f} "
              f"draft={1e3 * s.time_draft / n:.2f}ms verify={1e3 * s.time_verify / n:.2f}ms "
              f"other={1e3 * s.time_other / n:.2f}ms prefill={1e3 * s.time_prefill:.1f}ms", flush=True)
        profiled(call, f"{out}_8b_{name}.txt", 60)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--parts", nargs="+", default=["code_tiny", "eight_b"])
    a = p.parse_args()
    for part in a.parts:
        globals()[part](a.out)
