"""transformers and accelerate folders, their index and side files."""
