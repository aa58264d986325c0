"""The DFlash drafter training recipe (PyTorch): regenerate, then train a z-lab-format drafter."""
