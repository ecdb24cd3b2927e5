"""The embedded inference engine: `LLM`, sampling parameters, and request outputs.

    from kvtier.engine import LLM, SamplingParams
    outputs = LLM("smollm2-135m").generate(["Hi!"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)

The names below are imported on first use, so reading the settings (`EngineConfig`) or
building the command line does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> module that defines it.
_EXPORTS = {
    "LLM": "kvtier.engine.llm",
    "EngineConfig": "kvtier.engine.engine_config",
    "load_engine_config": "kvtier.engine.config_sources",
    "CompletionOutput": "kvtier.engine.outputs", "Logprob": "kvtier.engine.outputs",
    "RequestMetrics": "kvtier.engine.outputs", "RequestOutput": "kvtier.engine.outputs",
    "RequestStatus": "kvtier.engine.request",
    "SamplingParams": "kvtier.engine.sampler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
