"""The OpenAI API: request bodies, responses, chat answers, errors and the OpenAPI document."""
