"""The `dflash-local` command: the umbrella parser and `generate` (main.py), how a reply is
printed (reply.py), the flags several commands share (flags.py). `serve`, `bench` and `train`
bring their own parsers."""
