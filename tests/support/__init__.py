"""What the tests share, one responsibility a module; a test module imports from here, never from
another test module. The pytest plugin (``fixtures``: each test's level, shared fixtures); a real
``ferry serve`` (``gateway_process``) or the gateway in this process (``harness``); real
redis-server, Ray and vLLM servers; tiny checkpoints, reference models and a toy serving mode;
the test's side of the fixed batcher and of the engine pool, and the lost-replica scenario;
streaming clients, usage records and engine reports as a user reads them; OS processes by pid;
and ``waiting``, the one helper that waits on a condition."""
