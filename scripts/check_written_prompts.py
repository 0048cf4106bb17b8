"""Check a round of prompts written for training (``feature-tune --written-prompts`` and its later rounds)
before any continuation is generated: every line a JSON object with a unique ``id``, a ``category`` and a
non-empty ``prompt``; no prompt repeated, none equal to one of an earlier round; and none near a held-out
prompt (the first 200 characters within a ``difflib.SequenceMatcher`` ratio of ``--ratio`` of any prompt of
the held-out files: the evaluation prompts must stay unlike the training ones). ``--remove`` rewrites the
round's files without the prompts near a held-out one; everything else is an error to fix by hand.

    python scripts/check_written_prompts.py scripts/data/written_c/*.jsonl \
        --earlier scripts/data/written/*.jsonl scripts/data/written_b/*.jsonl \
        --held-out ../shared/data/dev_prompts.jsonl scripts/data/*.jsonl
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys


def read_rows(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{n}: not JSON ({e})")
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                sys.exit(f"{path}:{n}: needs a non-empty string 'prompt'")
            rows.append(row)
    return rows


def near(prompt: str, others: list[str], ratio: float) -> str | None:
    """The first of ``others`` whose first 200 characters are within ``ratio`` of the prompt's, or None."""
    head = prompt[:200]
    matcher = difflib.SequenceMatcher(None, b=head, autojunk=False)  # b is the one it indexes once
    for other in others:
        matcher.set_seq1(other[:200])
        # the cheap upper bounds first: most pairs are far apart
        if matcher.real_quick_ratio() >= ratio and matcher.quick_ratio() >= ratio and matcher.ratio() >= ratio:
            return other
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="the round's prompt files (.jsonl: id, category, prompt)")
    ap.add_argument("--earlier", nargs="*", default=[], help="earlier rounds' prompt files")
    ap.add_argument("--held-out", nargs="*", default=[], help="held-out prompt files (dev and evaluation prompts)")
    ap.add_argument("--ratio", type=float, default=0.7, help="SequenceMatcher ratio counted as near (default 0.7)")
    ap.add_argument("--remove", action="store_true", help="rewrite the files without prompts near a held-out one")
    args = ap.parse_args(argv)
    rounds = {path: read_rows(path) for path in args.files}
    earlier = {row["prompt"] for path in args.earlier for row in read_rows(path)}
    held = [row["prompt"] for path in args.held_out for row in read_rows(path)]
    errors, ids, seen, drop = [], set(), set(), {}
    for path, rows in rounds.items():
        for row in rows:
            if not isinstance(row.get("category"), str) or not row["category"]:
                errors.append(f"{path}: {row.get('id')!r} has no category")
            if row.get("id") in ids:
                errors.append(f"{path}: id {row.get('id')!r} repeated")
            ids.add(row.get("id"))
            prompt = row["prompt"]
            if prompt in seen:
                errors.append(f"{path}: {row.get('id')!r} repeats a prompt of this round")
            if prompt in earlier:
                errors.append(f"{path}: {row.get('id')!r} equals a prompt of an earlier round")
            seen.add(prompt)
            other = near(prompt, held, args.ratio)
            if other is not None:
                drop.setdefault(path, set()).add(row.get("id"))
                print(f"near a held-out prompt: {path} {row.get('id')!r}: {prompt[:80]!r} ~ {other[:80]!r}")
    for error in errors:
        print(error)
    total = sum(map(len, rounds.values()))
    print(f"{total} prompts in {len(rounds)} files; {len(errors)} errors; "
          f"{sum(map(len, drop.values()))} near a held-out prompt")
    if args.remove and drop:
        for path, ids_out in drop.items():
            kept = [row for row in rounds[path] if row.get("id") not in ids_out]
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in kept)
            print(f"{path}: removed {len(ids_out)}, {len(kept)} left")
        drop = {}
    return 1 if errors or drop else 0


if __name__ == "__main__":
    sys.exit(main())
