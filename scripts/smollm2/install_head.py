"""Put a head trained by gpu_train.sh into the zoo: join its weight parts, check them, write the shipped folder.

    python scripts/smollm2/install_head.py RESULTS_DIR [--dest eagle_mm/zoo/models/smollm2-135m-instruct]

RESULTS_DIR is gpu_train.sh's $OUT as it came back: manifest.json, eagle3/config.json and
eagle3/model.safetensors.part-* with eagle3/model.safetensors.sha256. The zoo folder gets manifest.json (the
recipe's, with the shipped files' sizes) and eagle3/ (config.json, model.safetensors).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--dest", type=Path, default=REPO / "eagle_mm/zoo/models/smollm2-135m-instruct")
    args = parser.parse_args(argv)
    manifest = json.loads((args.results / "manifest.json").read_text(encoding="utf-8"))
    if not manifest.get("complete"):
        raise SystemExit(f"error: {args.results}/manifest.json is not a complete run (a dry run, or it failed)")
    stage = args.dest.with_name(args.dest.name + ".tmp")
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "eagle3").mkdir(parents=True)
    shutil.copy2(args.results / "eagle3" / "config.json", stage / "eagle3" / "config.json")
    join_parts(args.results / "eagle3", stage / "eagle3")
    manifest["files"] = {f"eagle3/{p.name}": p.stat().st_size for p in sorted((stage / "eagle3").iterdir())}
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    shutil.rmtree(args.dest, ignore_errors=True)
    stage.rename(args.dest)
    print(f"installed the head in {args.dest}: {manifest['files']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
