"""Helpers the tests share: gateways in a process or in this one, real redis-server and vLLM
servers, reference models, tiny checkpoints and a toy serving mode."""
