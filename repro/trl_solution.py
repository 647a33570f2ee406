def accuracy(completions, solution, **kwargs):
    return [float(c[0]["content"].strip() == s) for c, s in zip(completions, solution)]
