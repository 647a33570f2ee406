#!/bin/bash
# usage: repro/run.sh OUTDIR [overrides...]
OUT=$1; shift
cd /work/hunt_i
PYTHONPATH=/work/hunt_i exec /work/main/.venv/bin/python -c "from slime.cli import entry; entry()" train examples/repeat_grpo.yaml \
  steps=4 rollout.batch_size=2 rollout.n_samples_per_prompt=4 rollout.max_new_tokens=32 cluster.launcher=local \
  logging.progress=false checkpoint.every_steps=2 output_dir=$OUT "$@"
