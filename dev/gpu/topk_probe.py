"""torch.topk against a full sort, both timed inside a CUDA graph, as the engine replays them (the launch cost,
which eager timing would add, is gone there). Why the draft keeps torch.topk: a sort is slower for the rows a draft
selects from (8 rows of 8,192: 69 us against 43), dev/results/topk_probe_h200_2026-12-01.txt. The sampled draft's
cost went instead into fewer kernels (draft.DraftSampler.proposal); a profile of the sort-based draft is kept as
dev/results/profile_codetiny_sampled_sort_h200_2026-12-01.txt.

    PYTHONPATH=. python dev/gpu/topk_probe.py      (GPU only; one line per shape, microseconds per call)
"""
import torch

from bench.harness import gpu_us


def main():
    print("rows       V   k  topk_us  sort_us  topk/sort")
    for V in (600, 4096, 8192, 32000, 65536, 128256, 151936):
        for rows in (1, 8, 49, 64, 128):
            for k in (8, 50):
                xs = [(torch.randn(rows, V, device="cuda"),) for _ in range(4)]
                t = gpu_us(lambda x: torch.topk(x, k, dim=-1), xs)
                s = gpu_us(lambda x: torch.sort(x, dim=-1, descending=True), xs)
                print(f"{rows:4d} {V:7d} {k:3d} {t:8.1f} {s:8.1f} {t / s:9.2f}", flush=True)


if __name__ == "__main__":
    main()
