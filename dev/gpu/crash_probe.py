"""Narrows the H100 matrix's crash ("unspecified launch failure" in the prefill graph's replay at sampled batch 64's
first call, after the nine rows before it, with HF static generate in the same process; dev/results/run2, ab7, ab10,
ab12): runs bench_matrix.py's main with
  --eager-prefill  the prefill step eager under CUDA graphs (the other steps captured as ever);
  --trace          a log line (stderr) per prefill graph lookup (new signature or replay, the storage's generation and
                   cache address) and per decoder begin (generation before and after, cache slots).
    python dev/gpu/crash_probe.py [--eager-prefill] [--trace] -- <bench_matrix.py arguments>
"""
import logging
import runpy
import sys

import eagle_mm.decode.decoder as decoder
import eagle_mm.decode.graphs as graphs
import eagle_mm.decode.loop as loop
import eagle_mm.decode.runner as runner

log = logging.getLogger("crash_probe")


def _trace() -> None:
    begin, call = decoder.Decoder.begin, graphs.OwnGraph._call

    def traced_begin(self, tree, mode, batch, prompt_len, max_length, sampler=None, *, capacity=None):
        g0 = self.storage.generation
        begin(self, tree, mode, batch, prompt_len, max_length, sampler, capacity=capacity)
        s = self.storage
        log.warning("begin batch=%d prompt=%d max=%d sampled=%s tree=%s cap=%s gen %d->%d slots=%d", batch, prompt_len,
                    max_length, sampler is not None, tree, capacity, g0, s.generation, s.length)

    def traced_call(self, args, sig, undo=None):
        if self.what == "prefill step":
            target = args[1]
            layer = target.cache.layers[0]
            ptr = layer.keys.data_ptr() if layer.is_initialized else None
            log.warning("prefill %s keys@%s graphs=%d", "replay" if sig.key in self._graphs else "new", ptr,
                        len(self._graphs))
        return call(self, args, sig, undo)

    decoder.Decoder.begin, graphs.OwnGraph._call = traced_begin, traced_call


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    args = sys.argv[1:]
    if "--eager-prefill" in args:
        plain = runner.step_mode

        def step_mode(step, mode):
            return None if step == "prefill" and mode == "graphs" else plain(step, mode)
        runner.step_mode = loop.step_mode = step_mode
    if "--trace" in args:
        _trace()
    args = [a for a in args if a not in ("--eager-prefill", "--trace")]
    if args and args[0] == "--":
        args = args[1:]
    sys.argv = ["bench/bench_matrix.py"] + args
    runpy.run_path("bench/bench_matrix.py", run_name="__main__")
