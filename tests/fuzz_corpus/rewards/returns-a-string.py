def score(completions, **kwargs):
    return 'ab'
