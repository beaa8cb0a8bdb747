"""Cut a portable subset of the embedded ShareGPT chats for a GPU machine without the wheel.

Writes JSONL (OpenAI `messages`) of the first N usable conversations, keeping at most --turns
user turns and --max-chars characters per message, gzip-compressed; `eyas prepare` and
`eyas regenerate` read the unzipped file as any user JSONL.

    python lab/scripts/stage_chats.py OUT.jsonl.gz --n 5000
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from eyas.data.sources import Conversation, iter_conversations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--max-chars", type=int, default=3000)
    args = ap.parse_args()
    n = 0
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        for item in iter_conversations("sharegpt"):
            if not isinstance(item, Conversation):
                continue
            msgs, users = [], 0
            for m in item.messages:
                if m["role"] == "user":
                    users += 1
                    if users > args.turns:
                        break
                msgs.append({"role": m["role"], "content": m["content"][: args.max_chars]})
            f.write(json.dumps({"id": item.id, "messages": msgs}) + "\n")
            n += 1
            if n >= args.n:
                break
    print(json.dumps({"out": str(args.out), "conversations": n, "bytes": args.out.stat().st_size}))


if __name__ == "__main__":
    main()
