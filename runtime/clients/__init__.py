"""The engine's connections to the engine-manager and to its worker ranks."""
