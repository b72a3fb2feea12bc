"""batchrun: offline batch inference with its own throughput-maximised engine."""
from batchrun.outputs import RequestMetrics, RequestOutput, SamplingParams


def __getattr__(name):  # torch loads only when the engine is asked for
    if name == "LLM":
        from batchrun.api import LLM
        return LLM
    if name == "LLMEngine":
        from batchrun.engine.engine import LLMEngine
        return LLMEngine
    if name == "EngineConfig":
        from batchrun.engine.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestMetrics"]
__version__ = "0.1.0"
