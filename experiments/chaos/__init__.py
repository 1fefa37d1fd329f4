"""The chaos suite: a real gateway with real worker processes, open-loop HTTP load, faults on a
schedule, and every answer checked.

Theory of operation. Each *scenario* (``scenarios.py``) is one row of ``docs/RELIABILITY.md``:
a config for ``ferry serve`` (``server.py`` starts it on a free loopback port), a traffic plan
(``traffic.py``: Poisson arrivals, paid and free, streamed and whole, each request's text unique
so that its answer names it), and a fault that runs beside the traffic (``faults.py``: SIGKILL a
worker, SIGTERM the gateway, stop Redis, flood the sockets...). When the traffic ends, the
checks (``checks.py``, pure) read every answer and the gateway's usage table::

    sent        every request offered
    succeeded   a 200 whose text is its own input's answer (no cross-talk), body well formed
    documented  an error the scenario documents (its status, its body, a Retry-After on 529,
                an SSE ``error`` event for a stream that had started), never naming a pid
    lost        no answer at all (a reset, a timeout) where the gateway owed one
    duplicated  two answers or two usage records for one request
    violations  anything else: an undocumented status, a malformed body, another request's
                text, a usage record missing or disagreeing with what the client got

plus p99 latency, the time to recover after the fault, and the gateway's file descriptors,
threads and memory before and after (a leak shows as growth that does not come back).

    .venv/bin/python -m experiments.chaos                 # every scenario, writes docs/RELIABILITY.md
    .venv/bin/python -m experiments.chaos --only worker-kills --rate 1000 --duration 60
    .venv/bin/python -m experiments.chaos --short         # the seconds-long form (the CI rows)

Continuous-mode faults plug in the same way: a scenario with a continuous model's config, its
own expected answers (or none), and a fault that kills an engine worker mid-stream.
"""
