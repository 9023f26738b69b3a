"""GPU smoke check: greedy speculative decoding on CUDA (Triton verify) equals generate(), bf16 and fp32."""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import eagle_mm as em  # noqa: E402
from tests.doubles import ForcedHead  # noqa: E402
from tests.tiny import prompt, tiny_model  # noqa: E402

results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
for family in ("llama", "gemma2", "qwen2"):
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(family).to("cuda", dtype)
        ids = prompt(9, batch=2).cuda()
        ref = model.generate(ids, max_new_tokens=32, do_sample=False)
        ok = []
        for tree in (em.TreeConfig.chain(4), em.TreeConfig(depth=4, top_k=3, total_tokens=10)):
            out = em.speculative_generate(model, em.Eagle3Head.from_target(model), input_ids=ids,
                                          max_new_tokens=32, tree=tree)
            ok.append(bool(torch.equal(out, ref)))
        one = ids[:1]
        ref1 = model.generate(one, max_new_tokens=32, do_sample=False)
        long = model.generate(one, max_new_tokens=64, do_sample=False)[0]
        wrong = torch.rand(long.numel(), generator=torch.Generator().manual_seed(0)) < 0.2
        head = ForcedHead(em.Eagle3Head.from_target(model), long, wrong.cuda())
        out1 = em.speculative_generate(model, head, input_ids=one, max_new_tokens=32, tree=em.TreeConfig.chain(5),
                                       return_dict_in_generate=True)
        ok.append(bool(torch.equal(out1.sequences, ref1)))
        results[f"{family}-{dtype}"] = {"identical": ok, "forced_mean_accept": out1.stats.mean_accept_length}
print(json.dumps(results, indent=1))
out_dir = os.environ.get("OUT")
if out_dir:
    json.dump(results, open(os.path.join(out_dir, "gpu_smoke.json"), "w"), indent=1)
