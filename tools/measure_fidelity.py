"""How close a GGUF model's products come to its float32 oracle: the next-token distributions at every position of
the package's prompts (their first C characters, default 1,200), native weights (integer products) and weights
dequantized to bf16 against the exact values in float32; top-1 agreement and mean KL(oracle || ours), and
llama.cpp's on the same file beside them where llama-cpp-python is installed. What an arithmetic change (a bits
decision: how activations are quantized, say) costs a model, measured.

Run: .venv/bin/python tools/measure_fidelity.py [MODEL [PROMPTS]]   (a catalog name or a GGUF path; default
gemma-3-270m-q4_k_m, fetched first: `specserve models fetch gemma-3-270m-q4_k_m`; PROMPTS: a JSONL of Spec-Bench's
form, each line's first turn a prompt, default app/bench/prompts.jsonl)
"""

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app import store
from app.engine.model.loading import load_model
from app.engine.model.transformer import Transformer


def main() -> None:
    """What the docstring says, when run as a script."""
    name = sys.argv[1] if len(sys.argv) > 1 else "gemma-3-270m-q4_k_m"
    path = Path(name) if name.endswith(".gguf") else store.resolve(name)
    chars = int(os.environ.get("C", "1200"))
    source = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).parents[1] / "app/bench/prompts.jsonl"
    lines = [json.loads(line) for line in source.open()]
    oracle = load_model(path, "float32")
    prompts = [oracle.tokenizer.encode(d["turns"][0][:chars]) for d in lines]
    ours = {f"ours, {w}": load_model(path, "auto", weights=w) for w in ("native", "bf16")}
    systems = {name: _ours(loaded.model) for name, loaded in ours.items()}
    try:
        from llama_cpp import Llama
    except ImportError:
        pass
    else:
        llm = Llama(model_path=str(path), n_ctx=4096, logits_all=True, n_threads=2, n_batch=512, verbose=False)
        systems["llama.cpp"] = _llama_cpp(llm)
    # Per prompt, each system's agreement and KL summed (a model's logits over all positions at once would not fit).
    top1 = dict.fromkeys(systems, 0.0)
    kl = dict.fromkeys(systems, 0.0)
    with torch.inference_mode():
        for ids in prompts:
            want = oracle.model(torch.tensor([ids]))[0].float().log_softmax(-1)
            for system, run in systems.items():
                got = run(ids)[:, : want.shape[-1]].float().log_softmax(-1)
                top1[system] += (got.argmax(-1) == want.argmax(-1)).sum().item()
                kl[system] += (want.exp() * (want - got)).sum().item()
    positions = sum(map(len, prompts))
    print(f"{path.name}: {len(prompts)} prompts, {positions} positions, against float32")
    print("| system | top-1 agreement | mean KL |\n|---|---:|---:|")
    for system in systems:
        print(f"| {system} | {top1[system] / positions:.4f} | {kl[system] / positions:.5f} |")


def _ours(model: Transformer) -> Callable[[list[int]], torch.Tensor]:
    """A prompt's logits [len, vocab] from our model, its prefill from an empty cache."""
    return lambda ids: model(torch.tensor([ids]), 0, model.new_cache(len(ids)))[0]


def _llama_cpp(llm: Any) -> Callable[[list[int]], torch.Tensor]:
    """A prompt's logits [len, vocab] from llama.cpp (a `llama_cpp.Llama` made with logits_all)."""
    import numpy as np

    def run(ids: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)]))

    return run


if __name__ == "__main__":
    main()
