"""verl-style RL parquet + jsonl (prompt = chat messages with a system prompt, data_source,
reward_model.{style,ground_truth}, extra_info). Usage: python repro/make_data.py OUT_DIR"""
import json, sys, pathlib
import pyarrow as pa, pyarrow.parquet as pq
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rows = []
for i in range(8):
    rows.append({
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "system", "content": "You are a helpful math tutor."},
                   {"role": "user", "content": f"What is 2+3? ({i})"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {"split": "train", "index": i, "question": "What is 2+3?"},
    })
pq.write_table(pa.Table.from_pylist(rows), out / "train.parquet")
with open(out / "train.jsonl", "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
print(out)
