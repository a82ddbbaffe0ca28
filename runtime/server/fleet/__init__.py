"""The engines a server runs: each model's supervised engine, loaded, kept and unloaded."""
