"""The DFlash drafter: config parsing (framework-free) and one model per framework."""
