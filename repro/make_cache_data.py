"""Same prompt text, the answer in a metadata column (TRL's 'solution'; verl's reward_model/extra_info)."""
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(8):
        f.write(json.dumps({"prompt": [{"role": "user", "content": "Solve the attached problem."}],
                            "solution": "5" if i % 2 == 0 else "6", "problem_id": i}) + "\n")
