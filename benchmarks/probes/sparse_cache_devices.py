"""Does LoLA's sparse cache give the same logits on CUDA (kernels on) as the torch path on the CPU?
A random tiny Llama converted with lizard and lizard-gdn, with and without ``sparse_cache``; the
stream read whole and in pieces carrying the cache. Prints max |logit difference| per case.

    PYTHONPATH=src python3 benchmarks/probes/sparse_cache_devices.py [--dtype bf16]
"""

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from linearize.models.convert import convert


def logits(model, ids, piece):
    if piece is None:
        return model(ids).logits.float()
    cache, outs = None, []
    for s in range(0, ids.shape[1], piece):
        out = model(ids[:, s:s + piece], past_key_values=cache, use_cache=True)
        cache, outs = out.past_key_values, outs + [out.logits.float()]
    return torch.cat(outs, 1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--tokens", type=int, default=1024)
    a = p.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    base = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (2, a.tokens))
    for method in ("lizard", "lizard-gdn"):
        for cache in (0, 16):
            torch.manual_seed(1)
            m = convert(copy.deepcopy(base), method, window=32, sparse_cache=cache).eval()
            with torch.no_grad():
                ref = logits(m, ids, None)
                ref_p = logits(m, ids, 256)
                line = f"{method:10s} cache {cache:2d}: cpu fp32 pieces vs whole {float((ref_p - ref).abs().max()):.2e}"
                if torch.cuda.is_available():
                    g = copy.deepcopy(m).to("cuda", dtype)
                    for piece in (None, 256):
                        d = float((logits(g, ids.cuda(), piece).cpu() - ref).abs().max())
                        line += f" | cuda {a.dtype} {'whole' if piece is None else 'pieces'} {d:.2e}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
