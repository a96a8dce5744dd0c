"""Crash-safe output (temp file, fsync, rename) and the CRCs of file ranges that every reader and writer checks."""
