"""Model management: the catalog of target/drafter pairs, hub names and downloads, snapshot
manifests, whether a pair fits this machine, the default and embedded pair, precision."""
