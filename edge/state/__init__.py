"""State the edge keeps for clients: stored conversations and the response cache (`docs/state.md`).

`stage.StateStage` is the request-path entry; `conversations`, `responses` and `cache` hold the
logic; `redis_store.RedisState` is the one place that talks to Redis.
"""
