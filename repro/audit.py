"""Audit a (stopped) run dir: steps in metrics.jsonl, groups trained/claimed, checkpoints.
usage: python repro/audit.py OUTDIR [JOB_NAME]"""
import json, sys
from collections import Counter
from pathlib import Path
from slime.buffer import TrajectoryStore
from slime.buffer.redis_server import LocalRedisServer

run = Path(sys.argv[1]); job = sys.argv[2] if len(sys.argv) > 2 else "repeat-grpo"
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
steps = [r["step"] for r in rows]
print("metric steps:", steps, "dups:", [s for s, c in Counter(steps).items() if c > 1])
print("checkpoints:", sorted(p.parent.name for p in (run / "checkpoints").glob("step_*/driver_state.json")),
      "latest file:", (run / "checkpoints/latest").read_text() if (run / "checkpoints/latest").exists() else None)
with LocalRedisServer(run / "redis", password="audit") as server:
    store = TrajectoryStore.open(server.url, job, password="audit")
    print("counts:", {k: v for k, v in store.counts().items() if k.startswith("groups") or k in ("aborted", "queue_new", "queue_resume")})
    store.connection.close()
