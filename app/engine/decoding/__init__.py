"""Turning the target's logits into tokens: sampling, verification, penalties, grammars, log-probabilities, text."""
