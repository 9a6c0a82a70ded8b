"""Answer a prompt from the command line, streaming tokens as they come.

    python -m serving.generate "What is the capital of France?"
    python -m serving.generate "Hi" --speculative-config '{"method": "eagle3", "model": "DIR",
                                                            "num_speculative_tokens": 15}'

The prompt goes through the model's chat template unless --raw. Decoding is greedy
unless --temperature > 0. Runs on the serving engine (serving.LLM): one generation path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


from model import compile_cache
from model.weights import WEIGHTS_DTYPES
from serving.llm import LLM
from serving.params import SamplingParams, check_text



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--model", default="default",
                        help="'default' (embedded SmolLM2-135M-Instruct), a .gguf file, a HF directory, or "
                             "'deepseek-v4.1-tiny' (random weights, byte tokenizer: use --raw)")
    parser.add_argument("--weights-dtype", default=None, choices=WEIGHTS_DTYPES,
                        help="how the weights stay in memory: float32, bfloat16, gguf (a GGUF file's own "
                             "blocks), or a packed format (int8, w8a8, int4, fp8, q8_0, q4_0, q4_1)")
    parser.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    parser.add_argument("--num-scheduler-steps", type=int, default=1,
                        help="decode steps per jitted call (LLM(num_scheduler_steps=...)); tokens print in bursts")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="shard the model over this many devices (LLM(tensor_parallel_size=...))")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engines, each on its own tensor_parallel_size devices (LLM(data_parallel_size=...))")
    parser.add_argument("--expert-parallel-size", "-ep", type=int, default=1,
                        help="groups a MoE model's experts are split into whole, dividing tensor_parallel_size "
                             "(LLM(expert_parallel_size=...); 1 splits each expert tp ways)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--speculative-config", default=None,
                        help="JSON, as LLM(speculative_config=...): EAGLE-3 speculative decoding")
    parser.add_argument("--precompile", action="store_true",
                        help="compile every step shape at start-up (LLM(precompile=True)): no compile stalls later")
    parser.add_argument("--compile-cache-dir", default=None,
                        help=f"where compiled steps persist ('off' disables; default ${compile_cache.ENV} "
                             "or ~/.cache/kvfold/jax)")
    args = parser.parse_args(argv)
    try:
        check_text("prompt", args.prompt)  # bytes that were not UTF-8 arrive as lone surrogates
        speculative = None
        if args.speculative_config is not None:
            try:
                speculative = json.loads(args.speculative_config)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not JSON: {e}") from None
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        if not args.prompt:
            raise ValueError("prompt is empty")
        if args.compile_cache_dir is not None:  # compiled steps persist across runs (model/compile_cache.py)
            os.environ[compile_cache.ENV] = args.compile_cache_dir
        llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=1,
                  speculative_config=speculative, weights_dtype=args.weights_dtype,
                  tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                  expert_parallel_size=args.expert_parallel_size, precompile=args.precompile,
                  num_scheduler_steps=args.num_scheduler_steps)
        tok = llm.get_tokenizer()
        if not args.raw and not tok.chat_template:
            raise ValueError(f"{args.model} has no chat template (a base model such as gemma3-270m): "
                             "pass --raw for a plain completion")
        if args.raw:
            prompt = args.prompt
        else:
            ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=True)
            prompt = {"prompt_token_ids": ids}
        for delta in llm.stream(prompt, params):
            sys.stdout.write(delta.outputs[0].text)
            sys.stdout.flush()
    except ValueError as e:
        parser.error(str(e))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
