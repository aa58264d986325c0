"""The kind of each round, as a StepEvent's `mode` reports it."""

PLAIN = "plain"  # no drafter: plain decoding
SPECULATIVE = "speculative"  # a drafter round (a chain or a tree)
FALLBACK = "plain-fallback"  # auto chose a plain step: no width was expected to beat it,
# or the plain step that rounds timed against their price are compared with (observed.py)
PROBE = "probe"  # one speculative round tried while falling back
LOOKUP = "lookup"  # a round that verifies a prompt-lookup draft (lookup.py)
