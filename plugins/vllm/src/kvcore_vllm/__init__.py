"""kvcore-vllm: a vLLM V1 KV connector on kvcore (``kv_connector_module_path="kvcore_vllm.connector"``)."""
