"""The request bodies, each described once as a pydantic model: validation, its 400s and the
OpenAPI document's request schemas all come from these."""
