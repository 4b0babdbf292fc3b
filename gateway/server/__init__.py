"""One replica, composed and run: settings, the served model and where it comes from, the
runtime the routes share, the ledger and observability sinks, health routes, the Starlette
app, first-run bootstrap and ``tiergate serve`` under uvicorn."""
