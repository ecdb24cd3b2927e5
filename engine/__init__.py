"""The embedded inference engine: `LLM`, sampling parameters, and request outputs.

    from kvtier.engine import LLM, SamplingParams
    outputs = LLM("smollm2-135m").generate(["Hi!"], SamplingParams(max_tokens=32))
"""

from kvtier.engine.engine_config import EngineConfig
from kvtier.engine.llm import LLM
from kvtier.engine.outputs import RequestMetrics, RequestOutput
from kvtier.engine.request import RequestStatus
from kvtier.engine.sampler import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestMetrics", "RequestOutput", "RequestStatus",
           "SamplingParams"]
