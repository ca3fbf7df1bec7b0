"""minirt: a small, readable, correct LLM inference engine - the reference package of the minirt course.

    import minirt
    llm = minirt.LLM()                                   # the embedded Shakespeare model
    out = llm.generate(["ROMEO:"], minirt.SamplingParams(max_new_tokens=32))
    print(out[0].text)
"""

from minirt.engine import DEFAULT_MODEL, EngineFailedError
from minirt.llm import LLM, Engine          # the full engine (chapters 07 and 09), imported when first built
from minirt.model import load_model
from minirt.request import RequestMetrics, RequestOutput, StreamDelta
from minirt.sampling import SamplingParams
from minirt import generate  # noqa: F401  (minirt.generate.naive_generate, kv_cache_generate)

__version__ = "0.1.0"

__all__ = ["DEFAULT_MODEL", "Engine", "EngineFailedError", "LLM", "load_model", "RequestMetrics", "RequestOutput",
           "SamplingParams", "StreamDelta", "generate"]
