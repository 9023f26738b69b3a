"""bench_8b's default call with the greedy acceptance run three ways, to find what slowed its cycle by 0.95 ms after
commit d851088 (which captured the acceptance): ``graph`` as shipped (captured, the Triton kernel), ``eager`` (the
acceptance's step left uncaptured, as before d851088), ``torch`` (captured, the torch reference: set
EAGLE_MM_VERIFY_BACKEND=torch in the environment). Other arguments go to bench/bench_8b.py.

    PYTHONPATH=. python dev/gpu/accept8b.py eager --accept 4 --modes ceiling ours_default --out 8b.json
"""
import runpy
import sys
from pathlib import Path

variant = sys.argv.pop(1)
if variant == "eager":
    import eagle_mm.decode.runner as runner

    shipped = runner.step_mode
    runner.step_mode = lambda step, mode: None if step == "accept" else shipped(step, mode)
elif variant not in ("graph", "torch"):
    raise SystemExit(f"variant {variant!r}: graph, eager or torch")
sys.argv[0] = str(Path(__file__).resolve().parents[2] / "bench" / "bench_8b.py")
runpy.run_path(sys.argv[0], run_name="__main__")
