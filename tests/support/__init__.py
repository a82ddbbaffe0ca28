"""Helpers the tests share: models, managers, servers, references and worker hooks."""
