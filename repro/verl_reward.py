# verl-style custom reward (custom_reward_function.path / name=compute_score), unchanged.
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert extra_info["split"] == "train"          # verl passes the row's extra_info column
    return 1.0 if solution_str.strip() == ground_truth else 0.0
