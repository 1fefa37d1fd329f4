"""Text on its way in and out: tokenizers, chat templates, the answer built from a job's events,
stop sequences and the safety stage."""
