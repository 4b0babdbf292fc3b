"""tiergate's benchmarks and scheduling simulation, behind the `bench` extra (aiohttp, matplotlib).

- serve: `tiergate bench serve` and `tiergate bench peer`, HTTP load against real servers
- offline: `tiergate bench offline`, the engine on a workload file, optionally vs HF generate
- engine: `tiergate bench engine`, the engine's host work per step; device: its device half
- admission: `tiergate bench admission`, how long admission's decisions take
- simulation: tiered vs FCFS scheduling on a simulated machine (`make sim`)
- workload: the workload files of ops/bench/inputs; stats: latency percentiles

Nothing here is imported by serving: `tiergate bench` imports a benchmark when it runs. The
fake runners and the simulated clock are engine.testing.
"""
