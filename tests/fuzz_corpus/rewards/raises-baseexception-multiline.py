def score(completions, **kwargs):
    raise BaseException('line one\nline two')
