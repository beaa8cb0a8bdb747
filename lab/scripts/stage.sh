#!/usr/bin/env bash
# Build the staged files a GPU session carries (not in git; .stage/ is in .git/info/exclude):
#   .stage/a2: smol.gguf.aa (first half of the embedded SmolLM2 GGUF), wheels the device lacks (gguf;
#              specforge 0.2.0 and what its `specforge train` imports beyond the device image: pydantic (with the
#              typing-inspection and typing-extensions it needs: 0.4.2 broke its import on 2026-12-01),
#              datasets, dill, multiprocess), question.jsonl (MT-bench),
#              chats_all.jsonl.xz (17,293 whole ShareGPT chats, lab/scripts/stage_chats.py --n 20000)
#   .stage/b:  smol.gguf.ab (second half)
# Each folder stays under one call's 64 MiB. Run from the repository root after scripts/setup.sh:
#   bash lab/scripts/stage.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .stage/a2 .stage/b
exclude="$(git rev-parse --git-dir)/info/exclude"
grep -qx '/.stage/' "$exclude" 2>/dev/null || echo '/.stage/' >> "$exclude"
gguf=$(PYTHONPATH=src $PY -c "from eyas.defaults import gguf_path; print(gguf_path())")
rm -f .stage/a2/smol.gguf.* .stage/b/smol.gguf.*
split -n 2 "$gguf" /tmp/smol.gguf. && mv /tmp/smol.gguf.aa .stage/a2/ && mv /tmp/smol.gguf.ab .stage/b/
PYTHONPATH=src $PY -c "from eyas.defaults import mtbench_path; import shutil; shutil.copy(mtbench_path(), '.stage/a2/question.jsonl')"
if [ ! -s .stage/a2/chats_all.jsonl.xz ]; then
    PYTHONPATH=src $PY lab/scripts/stage_chats.py /tmp/chats_all.jsonl.gz --n 20000
    gunzip -c /tmp/chats_all.jsonl.gz | xz -9 > .stage/a2/chats_all.jsonl.xz
fi
# the device: Python 3.12, x86-64, no package index
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .stage/a2 gguf==0.19.0 specforge==0.2.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.7.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 datasets==5.0.0 dill==0.4.1 multiprocess==0.70.19
du -sh .stage/a2 .stage/b
