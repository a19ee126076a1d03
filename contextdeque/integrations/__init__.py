"""contextdeque inside other serving engines: ``contextdeque.integrations.vllm`` is a vLLM KV
connector (``KVConnectorBase_V1``) that serves a chat prompt's earlier messages from
contextdeque's stores, relocated and patched, instead of vLLM's prefill (``docs/vllm.md``).
``paged`` holds what such a connector needs without importing the engine."""
