def score(completions, **kwargs):
    import time
    time.sleep(1000)
    return [1.0] * len(completions)
