"""Pure transforms over state dicts and optimizer state: key layouts, renames, no I/O."""
