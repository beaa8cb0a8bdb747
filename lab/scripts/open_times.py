"""How long the SGLang capture's store opening takes on this host, step by step, in a fresh process (issue 41):
import torch, import the capture client, the target's identity (twice), its tokenizer loaded (twice) and hashed.
A first call well above the second is a one-time import inside it.

    PYTHONPATH=src python3 lab/scripts/open_times.py [TARGET_DIR]   (default /root/eyas-stage/smol, serve_live's)
"""

import json
import sys
import time

t0 = time.time()
import torch  # noqa: E402

t1 = time.time()
sys.path.insert(0, "src")
import eyas.sglang.client  # noqa: E402,F401

t2 = time.time()
from eyas.target import load_tokenizer, model_identity, tokenizer_hash  # noqa: E402

p = sys.argv[1] if len(sys.argv) > 1 else "/root/eyas-stage/smol"
a = time.time()
model_identity(p)
b = time.time()
model_identity(p)
c = time.time()
tok = load_tokenizer(p)
d = time.time()
tokenizer_hash(tok)
e = time.time()
load_tokenizer(p)
f = time.time()
print(
    json.dumps(
        {
            "import_torch": t1 - t0,
            "import_client": t2 - t1,
            "identity": b - a,
            "identity_again": c - b,
            "load_tokenizer": d - c,
            "tokenizer_hash": e - d,
            "load_tokenizer_again": f - e,
            "torch": torch.__version__,
        }
    )
)
