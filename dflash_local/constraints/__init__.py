"""Output constraints (JSON Schema, regex, Lark) compiled for a tokenizer; the method sees
only method/constraint.py's protocol."""
