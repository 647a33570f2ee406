"""TRL conversational dataset: prompt = messages (system + user), ground_truth column."""
import json, sys, pathlib
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
with open(out / "trl.jsonl", "w") as f:
    for i in range(8):
        f.write(json.dumps({"prompt": [{"role": "system", "content": "Answer with a number."},
                                       {"role": "user", "content": f"What is 2+3? ({i})"}],
                            "ground_truth": "5"}) + "\n")
