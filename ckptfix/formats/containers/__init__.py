"""One file's container: the zip archive, torch's zip checkpoint and archive layout, legacy torch, safetensors."""
