"""Where a no-tree decode spends more than HF's eager ``generate``, on a target whose step is fast (the tests' tiny
random Llama: ~3.7 ms a token on 2 CPU cores, as code-tiny's is on the GPU hosts' CPUs). Times each call whole and
the target forwards inside it (``model.forward`` wrapped), so "outside" is the loop's own host work:

    PYTHONPATH=. python dev/probes/plain_overhead.py
"""
import sys
import time

import torch

sys.path.insert(0, ".")
import eagle_mm  # noqa: E402
from tests.tiny import prompt, tiny_model  # noqa: E402

torch.set_num_threads(2)
model = tiny_model("llama")
head = eagle_mm.EagleHead.from_target(model)
ids = prompt(9)
kw = dict(max_new_tokens=128, min_new_tokens=128, do_sample=False)
none = eagle_mm.TreeConfig.none()
acc = [0.0, 0]
orig = model.forward


def timed_forward(*a, **k):
    s = time.perf_counter()
    out = orig(*a, **k)
    acc[0] += time.perf_counter() - s
    acc[1] += 1
    return out


model.forward = timed_forward
for _ in range(3):
    eagle_mm.speculative_generate(model, head, ids, **kw, tree=none)
    model.generate(ids, **kw)
for name, f in (("ours, no tree", lambda: eagle_mm.speculative_generate(model, head, ids, **kw, tree=none)),
                ("HF eager", lambda: model.generate(ids, **kw))):
    runs = []
    for _ in range(7):
        acc[:] = [0.0, 0]
        s = time.perf_counter()
        f()
        runs.append((time.perf_counter() - s, *acc))
    total, fwd, n = sorted(runs)[3]
    print(f"{name}: {total * 1e3:.1f} ms, {n} forwards {fwd * 1e3:.1f} ms, outside them {(total - fwd) * 1e3:.1f} ms "
          f"({(total - fwd) / 128 * 1e3:.3f} ms a token)")
