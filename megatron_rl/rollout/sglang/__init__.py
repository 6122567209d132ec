"""SGLang servers: launch with the API key, the engine over HTTP, weight sync (tensor, distributed, disk) and its
guarded store."""
