"""`tiergate bench serve`: an open-loop HTTP + SSE load generator against real servers, and
a sweep comparing server configurations at multiples of the measured capacity.

One concept per module; import from them (this package imports nothing, so reading the
command's options stays cheap):

- plan: what is sent when (workload re-timed to a load, token-id prompts)
- loadgen: sending and timing (LoadGenerator, RequestResult)
- stats: SLO attainment, goodput, latencies per tier and tenant (summarize, RunSummary)
- server_process: a server subprocess started here (ServerProcess); server: tiergate
  configurations under comparison (BenchServer, VARIANTS); provision: tenants and keys
- session: one run against one server (BenchTarget); calibration: SLO scale and capacity
- sweep_config, sweep: the comparison (SweepConfig, run_sweep); report: tables and JSON;
  plots: PNG figures; machine: what it ran on; progress: the progress bar
- command: the command line; errors: BenchServeError and its subclasses
- peer, peer_client, peer_prompts, peer_servers, llamacpp_build: `tiergate bench peer`, the
  default model against llama.cpp's llama-server
- process_memory, peak_sampler, victim: for ops/bench's hostile-tenant scripts, a server's
  VmRSS (ServerRssReader), its peak over a span (PeakSampler), another tenant's timed chat
  (victim_chat), raw_client (requests on a raw socket: a stream left unread, a connection
  dropped after its first bytes)
"""
