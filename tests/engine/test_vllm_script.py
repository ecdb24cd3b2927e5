"""A vLLM offline-inference script runs unchanged once its import names kvtier.

The script below uses only what such scripts use: `LLM(model=<hub id>)`, `SamplingParams`,
`generate`, `chat` and `outputs[0].outputs[0].text`. The model comes from a local Hugging
Face cache built in a temporary directory (kvtier never downloads).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import converted_model_dir

from tests.engine.test_loader import make_hub_cache

REPO_ROOT = Path(__file__).resolve().parents[2]

VLLM_SCRIPT = '''\
from vllm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The capital of France is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=0)


def main():
    llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

    conversation = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write one sentence about Paris."},
    ]
    outputs = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=16))
    print("Chat:", repr(outputs[0].outputs[0].text))


if __name__ == "__main__":
    main()
'''


def test_vllm_offline_script_runs_after_switching_its_import(smollm2, tmp_path) -> None:
    hub = tmp_path / "hub"
    make_hub_cache(hub, "HuggingFaceTB/SmolLM2-135M-Instruct", converted_model_dir())
    script = tmp_path / "offline_inference.py"
    ported = VLLM_SCRIPT.replace("from vllm import LLM, SamplingParams",
                                 "from kvtier.engine import LLM, SamplingParams")
    assert ported.count("\n") == VLLM_SCRIPT.count("\n") and ported != VLLM_SCRIPT
    script.write_text(ported)
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1",
               KVTIER_CACHE_DIR=str(tmp_path / "kvtier-cache"))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split(",")[0] for line in lines[:2]] == [
        "Prompt: 'Hello", "Prompt: 'The capital of France is'"]
    assert all(", Generated text: " in line for line in lines[:2])
    # Greedy chat through the template gives the answer the library gives in-process.
    with LLM(smollm2, gpu_blocks=64, host_cache=False, disk_cache=False) as llm:
        (expected,) = llm.chat([{"role": "system", "content": "You are a helpful assistant."},
                                {"role": "user", "content": "Write one sentence about Paris."}],
                               SamplingParams(temperature=0, max_tokens=16))
    assert lines[2] == f"Chat: {expected.outputs[0].text!r}"
    assert expected.outputs[0].text.strip()
