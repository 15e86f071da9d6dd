"""Evaluation: passkey retrieval, perplexity, lm-eval tasks, the attention-transfer report.

Each evaluation writes ``NAME.json`` (the numbers), ``NAME.png`` drawn from that JSON as read
back from disk, and ``NAME.md`` (a short summary with one table, models side by side).
"""
