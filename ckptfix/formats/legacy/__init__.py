"""torch's pre-1.6 checkpoint format."""
