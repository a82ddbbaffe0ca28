"""The engine-manager daemon: launches, watches, lends and reuses worker groups."""
