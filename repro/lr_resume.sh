#!/bin/bash
# resume=auto with a new learner.lr: which lr trains the resumed steps?
cd /work/hunt_i; D=/tmp/hunt_i_lr; rm -rf $D
./repro/run.sh $D steps=4 > /dev/null 2>&1
./repro/run.sh $D steps=6 resume=auto learner.lr=1e-5 2>&1 | grep -v "Loading\|Writing" | tail -3
/work/main/.venv/bin/python -c "
import json
for l in open('$D/metrics.jsonl'): d=json.loads(l); print('step', d['step'], 'lr', d['lr'])"
