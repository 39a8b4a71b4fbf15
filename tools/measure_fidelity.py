"""How close a GGUF model's products come to its float32 oracle: the next-token distributions at every position of
the package's prompts (their first C characters, default 1,200), native weights (integer products) and weights
dequantized to bf16 against the exact values in float32; top-1 agreement and mean KL(oracle || ours), and
llama.cpp's on the same file beside them where llama-cpp-python is installed. What an arithmetic change (a bits
decision: how activations are quantized, say) costs a model, measured.

Run: .venv/bin/python tools/measure_fidelity.py [MODEL]   (a catalog name or a GGUF path; default
gemma-3-270m-q4_k_m, fetched first: `specserve models fetch gemma-3-270m-q4_k_m`)
"""

import json
import os
import sys
from pathlib import Path

import torch

from app import store
from app.engine.model.loading import load_model


def main() -> None:
    """What the docstring says, when run as a script."""
    name = sys.argv[1] if len(sys.argv) > 1 else "gemma-3-270m-q4_k_m"
    path = Path(name) if name.endswith(".gguf") else store.resolve(name)
    chars = int(os.environ.get("C", "1200"))
    lines = [json.loads(line) for line in (Path(__file__).parents[1] / "app/bench/prompts.jsonl").open()]
    oracle = load_model(path, "float32")
    prompts = [oracle.tokenizer.encode(d["turns"][0][:chars]) for d in lines]
    ours = {w: load_model(path, "auto", weights=w) for w in ("native", "bf16")}
    logits = {}
    with torch.inference_mode():
        want = [oracle.model(torch.tensor([ids]))[0].float().log_softmax(-1) for ids in prompts]
        for w, loaded in ours.items():
            logits[f"ours, {w}"] = [
                loaded.model(torch.tensor([ids]), 0, loaded.model.new_cache(len(ids)))[0].float().log_softmax(-1)
                for ids in prompts
            ]
    try:
        import numpy as np
        from llama_cpp import Llama
    except ImportError:
        pass
    else:
        llm = Llama(model_path=str(path), n_ctx=4096, logits_all=True, n_threads=2, n_batch=512, verbose=False)
        logits["llama.cpp"] = []
        for ids, ref in zip(prompts, want, strict=True):
            llm.reset()
            llm.eval(ids)
            got = torch.from_numpy(np.array(llm.scores[: len(ids)]))[:, : ref.shape[-1]]
            logits["llama.cpp"].append(got.float().log_softmax(-1))
    print(f"{path.name}: {len(prompts)} prompts, {sum(map(len, prompts))} positions, against float32")
    print("| system | top-1 agreement | mean KL |\n|---|---:|---:|")
    for system, rows in logits.items():
        top1 = torch.cat([(g.argmax(-1) == w.argmax(-1)).float() for g, w in zip(rows, want, strict=True)])
        kl = torch.cat([(w.exp() * (w - g)).sum(-1) for g, w in zip(rows, want, strict=True)])
        print(f"| {system} | {top1.mean().item():.4f} | {kl.mean().item():.5f} |")


if __name__ == "__main__":
    main()
