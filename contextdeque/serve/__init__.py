"""``contextdeque serve``: an OpenAI-compatible chat endpoint whose conversations are context
windows, with replicas sharing chunks and patches through a Valkey store tier."""
