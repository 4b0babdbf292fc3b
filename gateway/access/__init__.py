"""Who gets in: API keys resolved to tenants through a TTL cache (auth), and admission: the
policies' rate limits, budgets and shedding behind the routes, refusals as 429/503 with
their retry headers (admission), a refused large body's answer held for its retry delay
(refusal_hold)."""
