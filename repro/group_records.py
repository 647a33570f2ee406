"""Redis memory of a long job's buffer after pruning, per step, with the metadata of
examples/data/swe_tasks.jsonl (9.2 KB a row) on every group: 4 groups x 2 samples a step,
commit_through(step, keep_trained_steps=5) each step, as the job's checkpoints do.
usage: python repro/group_records.py REDIS_PORT"""
import json, sys, time
import numpy as np
from slime.buffer import TrajectoryStore
from slime.sample import Status

rows = [json.loads(line) for line in open("examples/data/swe_tasks.jsonl")]
buf = TrajectoryStore.open(f"redis://127.0.0.1:{sys.argv[1]}/0", f"growth-{int(time.time())}")
r = buf.redis
base = r.info("memory")["used_memory"]
for step in range(400):
    for g in range(4):
        row = rows[(step * 4 + g) % len(rows)]  # what slime/data.py makes of a row: its columns, label, prompt_text
        meta = {"task": row["task"], "label": row["label"], "prompt_text": row["prompt"]}
        buf.add_group(np.arange(1, 50), n=2, max_new_tokens=8, metadata=meta)
    for s in buf.lease("w", 8):
        buf.append_chunk(s.id, "w", list(range(1, 30)), [-0.1] * 29, version=step)
        buf.finish(s.id, "w", Status.COMPLETED, reward=1.0)
    buf.claim_groups(4, step)
    buf.commit_through(step, keep_trained_steps=5)
    if step % 100 == 99:
        # Reply records (reply:*) expire after 120 s; everything else is what the job keeps.
        mem = sum(r.memory_usage(k) or 0 for k in r.scan_iter(match=buf._key("*"), count=1000) if b":reply:" not in k)
        counts = buf.counts()
        print(f"step {step + 1}: job keys (replies aside) {mem / 2**20:.2f} MB, samples stored {counts['completed']}, "
              f"groups {counts['groups_total']}, pruned {buf.stats().get('pruned_groups')}", flush=True)
buf.delete_job()
