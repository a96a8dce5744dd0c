"""What a pickle may name (the allowlist), the proof that lets one take the C unpickler, how deep trees may nest."""
