"""tiergate's gateway: the only package that wires the others into a serving process.

One sub-package per concern:

- ``http``: what every route shares: the OpenAI-shaped error tree, JSON bodies, request ids.
- ``access``: who gets in: tenant keys to principals, admission and its 429/503 refusals.
- ``openai``: the OpenAI-compatible API: request schema, generation, tool calls, responses.
- ``admin``: the admin API, its token, the console, billing and live read-outs.
- ``observability``: Prometheus metrics, TTFT paging, OpenTelemetry, event-loop health.
- ``server``: one replica: settings, runtime, served model, app, ``tiergate serve``.

``cli`` and ``commands`` are the ``tiergate`` command line. No other project package imports
the gateway: it has no public names.
"""

__all__: list[str] = []
