#!/usr/bin/env bash
# Makes .pre37/ (git-ignored): commit b360572's eagle_mm/ and bench/, the code before issue 37, for the A/B scripts
# (ab4_run.sh, ab_interleaved.sh; pass carry [".pre37"] to the device). Its bench_matrix.py gets ONLY_OURS=1: only
# the default call runs, and the tokens are counted from its own output (code-tiny rows decode min_new_tokens).
set -eu
cd "$(dirname "$0")/../.."
rm -rf .pre37 && mkdir .pre37
git archive b360572 eagle_mm bench | tar -x -C .pre37
rm -rf .pre37/eagle_mm/zoo/models/*  # the scripts copy code-tiny in: the device carries 64 MiB in all
python3 - <<'PY'
p = ".pre37/bench/bench_matrix.py"
s = open(p).read()
only = 'import os\nONLY = os.environ.get("ONLY_OURS") == "1"\n'
s = s.replace("import argparse\n", "import argparse\n" + only, 1)
s = s.replace('        if mode == "ragged":\n            methods["ours_whole_batch"]',
              '        if ONLY:\n            methods = {"ours": methods["ours"]}\n'
              '        if mode == "ragged" and not ONLY:\n            methods["ours_whole_batch"]', 1)
s = s.replace('tokens = _new_tokens(outs["hf_eager"]', 'tokens = _new_tokens(outs["ours" if ONLY else "hf_eager"]', 1)
s = s.replace('        ours = row["ours"]["tokens_per_s"]\n', '        ours = row["ours"]["tokens_per_s"]\n'
              '        if ONLY:\n            rows.append(row)\n            print(json.dumps(row), flush=True)\n'
              '            if args.out:\n                with open(args.out, "w", encoding="utf-8") as f:\n'
              '                    json.dump({"meta": meta, "rows": rows}, f, indent=1)\n            continue\n', 1)
s = s.replace("    print(f\"{'row':<10}", "    if ONLY:\n        return {\"meta\": meta, \"rows\": rows}\n    print(f\"{'row':<10}", 1)
assert s.count("ONLY") == 7, s.count("ONLY")
open(p, "w").write(s)
PY
echo "made .pre37 ($(du -sh .pre37 | cut -f1))"
