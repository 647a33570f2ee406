# TRL GRPOTrainer reward functions as TRL's docs write them for a conversational dataset.
def accuracy(completions, ground_truth, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if c.strip() == str(g) else 0.0 for c, g in zip(contents, ground_truth)]
