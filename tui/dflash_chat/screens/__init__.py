"""The app's screens, each beside its .tcss."""
