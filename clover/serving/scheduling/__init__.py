"""Continuous batching: `scheduler` (the batch's background thread), `scheduler_policy` (admit / join / step / drop,
without threads), `handles` (a request's asyncio side), `prefix_cache` (reused prompt prefixes) + `prefix_blocks`
(the KV blocks its entries share), `heap` (free heap memory given back when idle)."""
