"""``python -m workers.bench _push``: the pushing process of ``bench ttft`` (it reads its spec
as JSON on stdin and prints what it measured as JSON)."""

from __future__ import annotations

import json
import sys

from .ttft import push_phase

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_push":
        result = push_phase(json.loads(sys.stdin.read()))
        print(json.dumps(result))
        sys.exit(0)
    raise SystemExit("use: kvcloud-worker bench ttft …")
