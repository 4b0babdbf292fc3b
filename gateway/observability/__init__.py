"""What the replica tells its operators: Prometheus metrics and the tenant-free view of
them, in-process TTFT paging to webhooks, OpenTelemetry spans, the engine's and the
dependencies' health, and the event loop's lag with what held it (collector pauses,
threads' CPU time, run-queue wait). Imports nothing else of the gateway."""
