"""The embedded inference engine: `LLM`, sampling parameters, and request outputs.

    from engine import LLM, SamplingParams
    outputs = LLM("smollm2-135m").generate(["Hi!"], SamplingParams(max_tokens=32))
"""

from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.outputs import RequestMetrics, RequestOutput
from engine.request import RequestStatus
from engine.sampler import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestMetrics", "RequestOutput", "RequestStatus",
           "SamplingParams"]
