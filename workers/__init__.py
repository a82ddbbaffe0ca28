"""The device side: the engine-manager daemon and the worker processes it launches."""
