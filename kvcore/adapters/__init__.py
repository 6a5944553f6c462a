"""Engine adapters: kvcore shaped as an engine's own transfer interface (TensorRT-LLM, SGLang).

Each adapter drives one :class:`~kvcore.transceiver.Transceiver` per rank and imports nothing of the engine it
adapts: it reads the few request fields it needs through a small protocol, so it is tested here without the engine
installed. vLLM has its own distribution (``plugins/vllm``, ``KvcoreConnector``).

* :mod:`kvcore.adapters.trtllm`: ``KvcoreCacheTransceiver``, TensorRT-LLM's ``KvCacheTransceiver`` interface.
* SGLang: not yet (work in progress).
"""

from __future__ import annotations
