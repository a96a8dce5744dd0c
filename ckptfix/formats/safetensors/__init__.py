"""safetensors files."""
