"""The vLLM connector: kvstore as vLLM's external prefix cache. vLLM loads
`kvstore.integrations.vllm.connector` (`kv_connector_module_path`); the other modules
import without vLLM."""
