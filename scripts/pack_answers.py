"""Pack the LLM's own answers of a feature corpus (``specjax.boost.feature_corpus``) into a shipped corpus
for the corpus drafter (``models/<name>/documents.npz``, ``specjax.speculation.drafters.corpus``).

Each document is one continuation the LLM wrote (its prompt is left out: the drafter copies answers),
from the corpus parts named (the default: every part of continuations; not the written requests, which
are prompts, nor the eval-* folders, which are the dev prompts' continuations). Prints what it packed.

    mkdir -p feature-out && for t in v2 v3_requests v4_requests_b; do \\
        tar -xJf scripts/data/feature_corpus_$t.tar.xz -C feature-out; done
    python scripts/pack_answers.py --corpus feature-out/feature-corpus --out models/smollm2-answers
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PARTS = "passages,grounded-greedy,grounded-sampled,tasks-greedy,tasks-sampled,requests,requests-b"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="the feature corpus directory (extracted tarballs)")
    ap.add_argument("--out", required=True, help="the shipped corpus's directory (documents.npz, packed.json)")
    ap.add_argument("--parts", default=PARTS, help=f"comma-separated parts (default {PARTS})")
    args = ap.parse_args()

    import numpy as np

    from specjax.boost.corpus import read_shard
    from specjax.io.registry import CORPUS_FILE
    from specjax.speculation.drafters.corpus import load_documents, save_documents

    docs, summary = [], {}
    for part in args.parts.split(","):
        folder = os.path.join(args.corpus, part)
        shards = sorted(n for n in os.listdir(folder) if n.startswith("shard-") and n.endswith(".npz")) \
            if os.path.isdir(folder) else []
        if not shards:
            sys.exit(f"{folder}: no shard-*.npz (extract the corpus tarballs first)")
        before = len(docs)
        for name in shards:
            docs += [ids[prompt_len:] for ids, prompt_len in read_shard(os.path.join(folder, name))]
        summary[part] = {"documents": len(docs) - before, "tokens": sum(len(d) for d in docs[before:])}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, CORPUS_FILE)
    save_documents(path, docs)
    again = load_documents(path)
    assert len(again) == len(docs) and all(np.array_equal(a, b) for a, b in zip(again, docs)), "round trip"
    total = {"documents": len(docs), "tokens": sum(len(d) for d in docs), "bytes": os.path.getsize(path)}
    with open(os.path.join(args.out, "packed.json"), "w") as f:
        json.dump({"parts": summary, "total": total, "corpus": "scripts/data/feature_corpus_*.tar.xz",
                   "command": " ".join(["python"] + sys.argv)}, f, indent=1)
    print(json.dumps({"parts": summary, "total": total}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
