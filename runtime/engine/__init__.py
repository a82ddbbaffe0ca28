"""The engine: the user's Engine, its replicas, its step loop and its output streams."""
