def score(completions, **kwargs):
    return [float('nan')] * len(completions)
