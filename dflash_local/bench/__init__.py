"""`dflash-local bench`: plain vs speculative decoding through the same loop, and the peers.

datasets.py (prompts), measure.py (our runs, interleaved), peers.py (Transformers and mlx-lm
generation, prompt lookup, assisted), report.py (JSON record, table, PNG), cli.py (the command).
"""
