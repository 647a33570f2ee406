# verl-style reward (like verl.utils.reward_score.gsm8k: compares with ground_truth only), logging what it gets.
import json, os
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ.get("HUNT_LOG", "/tmp/hunt_h_reward.log"), "a") as f:
        f.write(json.dumps({"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth}) + "\n")
    return 1.0 if solution_str.strip() == ground_truth else 0.0
