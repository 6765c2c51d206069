def score(completions, **kwargs):
    return None
