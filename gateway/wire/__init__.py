"""The wire formats, pure: what every route shares (errors and their one table, request limits),
the Anthropic Messages codec, the OpenAI-compatible codecs, and every error in its route's shape."""
