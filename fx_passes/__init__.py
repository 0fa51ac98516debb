"""FX passes of torch_sm70attn (installed as `torch_sm70attn.fx_passes`).

The rewrite of "SDPA over a paged E4M3 cache" into sm70attn.paged_attention, and of the
quantized cache write into sm70attn.store_kv, lands here with the torch.compile backend.
"""
