"""eyas: target hidden states -> verified store -> EAGLE-3 draft model -> SGLang/vLLM export.

Nothing runs at import time; each stage lives in its own subpackage (see README.md).
"""

__version__ = "0.1.0"
