"""``convert --format hf``: a checkpoint written as a transformers folder, proven against its model."""
