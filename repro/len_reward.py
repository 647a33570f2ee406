def score(prompt, response):
    return float(len(response)) / 50.0
