"""Generate text with SmolLM2-135M-Instruct packed by examples/smollm2_convert.py, out of process, as a user would.

    python examples/smollm2_convert.py --out smollm2 --method q8
    python examples/smollm2_generate.py smollm2/smollm2-q8.carton "What is the capital of France?"
    python examples/smollm2_generate.py smollm2/smollm2-q8.carton "Tell me a story." --temperature 0.8 --seed 3

The carton was packed in ``generate`` mode with ``chat = true``, so each prompt is wrapped in the model's chat
template (from tokenizer_config.json) inside the runner. Sampling options are runner options; they can be changed at
load time, as below, without repacking.
"""

from __future__ import annotations

import argparse
import time

import carton
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("carton", help="the .carton written by smollm2_convert.py")
    parser.add_argument("prompt", nargs="+", help="one or more prompts (generated as one batch)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()

    opts: dict[str, int | float] = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
    }
    if args.seed is not None:
        opts["seed"] = args.seed
    started = time.perf_counter()
    with carton.load(args.carton, runner_opts=opts) as model:
        loaded = time.perf_counter()
        texts = model.infer({"prompt": np.array(args.prompt)})["text"]
        done = time.perf_counter()
    for prompt, text in zip(args.prompt, texts, strict=True):
        print(f">>> {prompt}\n{text}\n")
    print(f"(load {loaded - started:.1f} s, generate {done - loaded:.1f} s)")


if __name__ == "__main__":
    main()
