"""Integrations with other libraries, each an optional extra (transformers: `pip install
torch-sm70attn[hf]`)."""
