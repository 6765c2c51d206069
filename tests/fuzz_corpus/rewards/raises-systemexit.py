def score(completions, **kwargs):
    raise SystemExit('bye')
