"""``etrain``: the command line, the REST client it uses, plain-text rendering, the local demo."""
