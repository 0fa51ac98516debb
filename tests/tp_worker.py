"""One rank (or the single process) of tests/test_transformers_tp.py: load the checkpoint
(tensor-parallel when started by torchrun), generate greedily and with prompt lookup through
the paged cache, and save what the attention and the cache saw."""

import os
import sys

import torch
import torch.distributed as dist
from transformers import AttentionInterface, AutoModelForCausalLM

from torch_sm70attn.integrations import transformers as hf


def main(ckpt: str, out: str) -> None:
    tp = "RANK" in os.environ
    hf.register()
    heads = []

    def spy(module, query, *args, **kwargs):  # the heads this rank's attention serves
        heads.append((query.shape[1], args[0].shape[1]))  # key [B, H_kv, Q, D]
        return hf.attention(module, query, *args, **kwargs)

    AttentionInterface.register(hf.NAME, spy)
    kw = {"tp_plan": "auto"} if tp else {}
    model = AutoModelForCausalLM.from_pretrained(
        ckpt, attn_implementation=hf.NAME, dtype=torch.float16, **kw
    ).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, 20), generator=g)
    ids = torch.cat([ids, ids[:, :10]], 1)  # a repetition for prompt lookup
    res = {}
    for name, extra in (("greedy", {}), ("lookup", {"prompt_lookup_num_tokens": 4})):
        cache = hf.PagedE4M3Cache(model.config, max_tokens=256, k_scale=0.5, v_scale=0.5)
        with torch.no_grad():
            o = model.generate(
                ids,
                cache=cache,
                max_new_tokens=24,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                **extra,
            )
        res[name] = o.sequences
        res[name + "_logits"] = torch.stack(o.logits)
        res["pool"] = tuple(cache.layers[0].keys.shape)
    res["heads"] = sorted(set(heads))
    rank = int(os.environ.get("RANK", 0))
    torch.save(res, f"{out}_{rank}.pt")
    if tp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
