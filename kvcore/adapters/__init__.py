"""Engine adapters: kvcore shaped as an engine's own transfer interface (TensorRT-LLM, SGLang).

Each adapter drives one :class:`~kvcore.transceiver.Transceiver` per rank and needs nothing of the engine it
adapts: it reads the few request fields it needs through a small protocol, so it is tested here without the engine
installed. vLLM has its own distribution (``plugins/vllm``, ``KvcoreConnector``).

* :mod:`kvcore.adapters.trtllm`: ``KvcoreCacheTransceiver``, TensorRT-LLM's ``KvCacheTransceiver`` interface.
* :mod:`kvcore.adapters.sglang`: ``KvcoreKVManager``, ``KvcoreKVSender``, ``KvcoreKVReceiver``, SGLang's disaggregation
  interface (subclassing SGLang's base classes where SGLang imports).
"""

from __future__ import annotations
