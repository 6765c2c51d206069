def score(completions, **kwargs):
    return [1.0] * (len(completions) + 1)
