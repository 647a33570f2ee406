#!/bin/bash
# A fresh run (no resume) in an output_dir that holds an older run's checkpoints, then resume=auto.
set -e; cd /work/hunt_i; D=/tmp/hunt_i_c; rm -rf $D
./repro/run.sh $D steps=8 > /dev/null 2>&1            # old run: checkpoints 2,4,6,8
./repro/run.sh $D steps=4 seed=1 > /dev/null 2>&1     # new run, fresh: checkpoints 2,4 rewritten
echo "== after the fresh run"; PYTHONPATH=. /work/main/.venv/bin/python repro/audit.py $D
echo "== resume=auto steps=6"; ./repro/run.sh $D steps=6 seed=1 resume=auto 2>&1 | grep -v "Loading\|Writing"
PYTHONPATH=. /work/main/.venv/bin/python repro/audit.py $D
