"""Integrations with other libraries, each an optional extra of the checkout's install
(transformers: `pip install -e '.[hf]'`; vLLM: `pip install -e '.[cuda12,vllm]'`)."""
